"""Skinny GEMM for decode: y = x @ w^T with few rows in x (M <= MAX_ROWS), bound by reading w.

Each program owns BLOCK_N output rows of w and streams them over the whole reduction (on an
H200, a sweep with 1, 2, 4 and 8 K slices never picked more than one at these shapes), so every
output is one fp32 dot product rounded once, with the same order for 1 to 16 rows (a row's
result does not depend on its batch). Against cuBLAS at M = 1..8 and the real MiniMax-M3 shapes
(docs/performance.md): lm_head 545 vs 595 µs, fused qkv 31.9 vs 35.4, dense down_proj 38.2 vs
43.8, o_proj and dense gate_up about equal (gate_up 71 vs 81 at 8 rows). `linear` uses it for
the shapes in `skinny_eligible`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.pdl import enabled as pdl_enabled
from m3serve.kernels.pdl import launch_options, pdl_start
from m3serve.kernels.rmsnorm import cast_rne, interpreting

MAX_ROWS = 8
_MIN_DIM = 4096   # smaller N or K (e.g. TP shards): cuBLAS, the measured range ends here


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, out_ptr, best_v_ptr, best_i_ptr, M, N, K, n_real, num_tiles,
                   stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   UPCAST: tl.constexpr, HEAD: tl.constexpr,
                   PDL: tl.constexpr):
    """out = x @ w^T rounded once to out's dtype; with HEAD, out is fp32 holding the product
    rounded to x's dtype (what `.float()` of a 16-bit product gives), columns >= n_real are -inf,
    and each row's largest value in this tile and its first column go to best_v/best_i
    [M, num_tiles] for `_argmax_finish_kernel`."""
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]                  # [BM, BK]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]    # [BN, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:                        # the interpreter's bf16 dot is not exact
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)                                          # [BM, BN]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if HEAD:
        y = cast_rne(acc, x_ptr.dtype.element_ty, UPCAST).to(tl.float32)
        y = tl.where((offs_n < n_real)[None, :], y, float("-inf"))                 # [BM, BN]
        tl.store(out_ptrs, y, mask=mask)
        best = tl.argmax(y, axis=1, tie_break_left=True)                          # [BM]
        tl.store(best_v_ptr + offs_m * num_tiles + pid_n, tl.max(y, axis=1), mask=m_ok)
        tl.store(best_i_ptr + offs_m * num_tiles + pid_n, pid_n * BLOCK_N + best, mask=m_ok)
    else:
        tl.store(out_ptrs, cast_rne(acc, out_ptr.dtype.element_ty, UPCAST), mask=mask)


@triton.jit
def _argmax_finish_kernel(best_v_ptr, best_i_ptr, ids_ptr, num_tiles, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    """ids[row] = the lowest column among the row's tile maxima that equal its overall maximum."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < num_tiles
    v = tl.load(best_v_ptr + row * num_tiles + offs, mask=ok, other=float("-inf"))
    col = tl.load(best_i_ptr + row * num_tiles + offs, mask=ok, other=2147483647)
    top = tl.max(v, axis=0)
    first = tl.min(tl.where(ok & (v == top), col, 2147483647), axis=0)
    tl.store(ids_ptr + row, first.to(tl.int64))


def skinny_config(N: int, K: int) -> dict:
    """Tiles by shape (measured): deep pipelines for the projections up to 12288 rows (wide
    tiles for the short-K fused qkv, long K steps for o_proj and the dense down_proj), shorter
    ones for wider weights (dense gate_up, the vocabulary-wide head)."""
    if N > 12288:
        return {"BLOCK_N": 64, "BLOCK_K": 256 if N >= 65536 else 128, "num_warps": 4, "num_stages": 3}
    if K <= 6144:
        return {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 5}
    return {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 5}


def skinny_eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The shapes the kernel is used for: <= MAX_ROWS rows, both dimensions >= 4096, 16-bit
    floats of one dtype, unit last strides."""
    return (x.dim() == 2 and w.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.shape[1] == w.shape[1] and min(w.shape) >= _MIN_DIM
            and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(-1) == 1 and w.stride(-1) == 1)


def _check_operands(x: torch.Tensor, w: torch.Tensor) -> None:
    M, K = x.shape
    if M > 16 or w.shape[1] != K or x.dtype != w.dtype or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"the skinny GEMM needs x [M <= 16, K] and w [N, K] of one dtype with unit "
                         f"last strides, got {tuple(x.shape)} {x.dtype} and {tuple(w.shape)} {w.dtype}")


def skinny_linear(x: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x: [M <= 16, K], w: [N, K], both bf16/fp16 with unit last stride -> [M, N] in x's dtype,
    accumulated in fp32 (the kernel takes up to 16 rows; `linear` routes up to MAX_ROWS, the
    measured range). `config` overrides the tiles (benchmarks)."""
    M, K = x.shape
    N = w.shape[0]
    _check_operands(x, w)
    cfg = config or skinny_config(N, K)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        pdl = pdl_enabled(x)
        _skinny_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
            x, w, out, out, out, M, N, K, N, 1, x.stride(0), w.stride(0), out.stride(0),
            BLOCK_M=16, UPCAST=interpreting(), HEAD=False, PDL=pdl, **cfg, **launch_options(pdl))
    return out


def skinny_head(x: torch.Tensor, w: torch.Tensor, num_real: int | None = None,
                config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An output head's logits and their argmax in two launches. x: [M <= 16, K], w: [N, K] as
    for `skinny_linear`; num_real: the real vocabulary rows (default N; later rows are padding).

    Returns (logits fp32 [M, N], ids int64 [M]): logits equal `skinny_linear(x, w).float()` with
    columns >= num_real set to -inf, ids equal `logits.argmax(-1)` (the lowest column among equal
    maxima) for finite logits. The fp32 widening and the argmax ride in the GEMM's epilogue, plus
    one small kernel over the per-tile maxima."""
    M, K = x.shape
    N = w.shape[0]
    _check_operands(x, w)
    num_real = N if num_real is None else num_real
    if not 0 < num_real <= N:
        raise ValueError(f"num_real={num_real} must be in 1..{N}")
    cfg = config or skinny_config(N, K)
    tiles = triton.cdiv(N, cfg["BLOCK_N"])
    logits = torch.empty((M, N), dtype=torch.float32, device=x.device)
    ids = torch.empty(M, dtype=torch.int64, device=x.device)
    if M:
        best_v = torch.empty((M, tiles), dtype=torch.float32, device=x.device)
        best_i = torch.empty((M, tiles), dtype=torch.int32, device=x.device)
        pdl = pdl_enabled(x)
        _skinny_kernel[(tiles,)](
            x, w, logits, best_v, best_i, M, N, K, num_real, tiles, x.stride(0), w.stride(0),
            logits.stride(0), BLOCK_M=16, UPCAST=interpreting(), HEAD=True, PDL=pdl, **cfg,
            **launch_options(pdl))
        _argmax_finish_kernel[(M,)](best_v, best_i, ids, tiles,
                                    BLOCK=triton.next_power_of_2(tiles), PDL=pdl, num_warps=4,
                                    **launch_options(pdl))
    return logits, ids
