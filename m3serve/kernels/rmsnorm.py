"""Triton Gemma RMSNorm (`x / rms(x) * (1 + w)`, fp32 inside) and the fused residual-add + norm
used between decoder sub-layers. One program per row; the whole row lives in registers.

Residual rounding (same as `ref/rmsnorm.py`): s = x + residual is formed in fp32 and stored
rounded to the activation dtype; the norm reads the rounded sum.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from m3serve.kernels.pdl import enabled as pdl_enabled
from m3serve.kernels.pdl import launch_options, pdl_start

MAX_ROW = 65536  # one row must fit one program's registers


def interpreting() -> bool:
    """True when kernels run under Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def cast_rne(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 -> dtype, round to nearest even. The interpreter truncates fp32 -> bf16 and mis-rounds
    fp32 -> e4m3 when the mantissa carries, so with EMULATE the value is first rounded to the
    target precision in fp32 (the final cast is then exact). GPU code passes EMULATE=False."""
    if EMULATE and dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    if EMULATE and dtype == tl.float8e4nv:
        u = x.to(tl.uint32, bitcast=True)
        normal = (u + 0x7FFFF + ((u >> 20) & 1)) & 0xFFF00000                 # 3 mantissa bits
        a = tl.abs(x)
        tiny = (a + 16384.0) - 16384.0                                        # multiple of 2^-9
        x = tl.where(a < 0.015625, tl.where(x < 0, -tiny, tiny),
                     normal.to(tl.float32, bitcast=True))
    return x.to(dtype)


# `quant` is a run-time flag, not a constexpr: the norm with and without its FP8 form is one
# compiled program, so the normed rows are the same bits either way (two compilations may sum
# the row's squares in different orders)
@triton.jit(do_not_specialize=["q_stride", "quant"])
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr,
                     x_stride, res_stride, out_stride, res_out_stride, q_stride, N, eps, min_scale, quant,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)   # in flight with x
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        if x.dtype != r.dtype:            # an fp32 sub-layer output: rounded to the stream's dtype first
            x = cast_rne(x, r.dtype, EMULATE)
        s = cast_rne(x.to(tl.float32) + r.to(tl.float32), r.dtype, EMULATE)  # like a bf16 add
        tl.store(res_out_ptr + row * res_out_stride + cols, s, mask=mask)
        x = s
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    rstd = tl.math.rsqrt(var + eps)
    y = cast_rne(xf * rstd * (1.0 + w), out_ptr.dtype.element_ty, EMULATE)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)
    if quant:   # the rounded output's per-row FP8 form, as `fused_moe.quant_rows_fp8` makes it
        yf = y.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(yf), axis=0) / 448.0, min_scale)
        q = cast_rne(tl.clamp(yf / scale, -448.0, 448.0), q_ptr.dtype.element_ty, EMULATE)
        tl.store(q_ptr + row * q_stride + cols, q, mask=mask)
        tl.store(s_ptr + row, scale)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """View x as [rows, N] with a unit last stride (copies only when it must)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({N},)")
    if N > MAX_ROW:
        raise ValueError(f"row width {N} > {MAX_ROW}")
    return N


def norm_warps(block: int) -> int:
    """Warps per row program (a function so benchmarks can swap it)."""
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


_PLACEHOLDERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [1, 1], fp32 [1]) on `device`, made once outside any CUDA-graph capture (inside
    one: made for that launch, in the graph's pool)."""
    found = _PLACEHOLDERS.get(device)
    if found is None:
        found = (torch.empty((1, 1), dtype=torch.float8_e4m3fn, device=device),
                 torch.empty(1, dtype=torch.float32, device=device))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _PLACEHOLDERS[device] = found
    return found


def _launch(x2, r2, weight, out2, res_out2, eps, N, q2=None, scale=None):
    from m3serve.kernels.ref.fused_moe import FP8_MIN_SCALE
    BLOCK = triton.next_power_of_2(N)
    num_warps = norm_warps(BLOCK)
    has_res, quant = r2 is not None, q2 is not None
    pdl = pdl_enabled(x2)
    if not quant:     # never written; of the FP8 form's types, so that both launch one program
        q2, scale = _placeholders(x2.device)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2 if has_res else x2, weight, out2, res_out2 if has_res else out2, q2, scale,
        x2.stride(0), r2.stride(0) if has_res else 0, out2.stride(0),
        res_out2.stride(0) if has_res else 0, q2.stride(0), N, eps, FP8_MIN_SCALE, int(quant),
        HAS_RESIDUAL=has_res, BLOCK=BLOCK, EMULATE=interpreting(), PDL=pdl, num_warps=num_warps,
        **launch_options(pdl))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm over the last dim. x: [..., N] (unit last stride preferred); weight: [N]
    (offset from 1). Returns a new contiguous [..., N] tensor in x's dtype.

    CUDA-graph safe: no host sync; one allocation sized from x.shape and one launch (plus a
    copy only when x's last stride is not 1)."""
    N = _check(x, weight)
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _launch(x2, None, weight, out.view(-1, N), None, eps, N)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual update + Gemma RMSNorm. x, residual: [..., N] of one shape, x in residual's dtype
    or fp32 (a sub-layer's unrounded output, rounded to residual's dtype first: the same values as
    casting it beforehand); weight: [N].

    Returns (normed, new_residual), both new contiguous [..., N] tensors in residual's dtype, with
    new_residual = dtype(dtype(x) + residual) and normed = rms_norm(new_residual).

    CUDA-graph safe: no host sync; two allocations sized from x.shape and one launch.
    """
    return _fused_add(x, residual, weight, eps, quant=False)[:2]


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """`fused_add_rms_norm` of x, residual [T, N] that also returns the normed rows' per-token
    FP8 form (e4m3 [T, N], fp32 scale [T]) -- bit-equal to `fused_moe.quant_rows_fp8` of the
    normed output, whose launch it saves (the FP8 experts' input)."""
    if x.dim() != 2:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype} (two dimensions)")
    return _fused_add(x, residual, weight, eps, quant=True)


def _fused_add(x, residual, weight, eps, quant: bool) -> tuple:
    """(normed, new residual, (e4m3 rows, scales) with `quant` else None): the one launch behind
    `fused_add_rms_norm` and `fused_add_rms_norm_fp8`."""
    N = _check(x, weight)
    if residual.shape != x.shape or x.dtype not in (residual.dtype, torch.float32):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    new_res = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    fp8 = None
    if quant:
        fp8 = (torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device),
               torch.empty(x2.shape[0], dtype=torch.float32, device=x.device))
    if x2.shape[0]:
        _launch(x2, r2, weight, out.view(-1, N), new_res.view(-1, N), eps, N, *(fp8 or ()))
    return out, new_res, fp8
