"""Packed weights: a layer's weight held as block-scaled codes (MXFP8, MXFP4, NVFP4) rather
than in the model's dtype, and the one place their products are computed.

A packed weight `W` of a module is three parameters: `W` itself (the codes), `W_block_scale`
and, for NVFP4, `W_global_scale` (fp32, one per output row: a fused layer's sections may each
bring their own). They keep the layer's `weight_loader`, which shards them like the weight: rows
for column-parallel layers, the reduction dimension (in codes and in scale blocks) for
row-parallel ones and the experts' down projection; a scale block may not straddle two ranks.
`dequantized` is the reference path (dequantise in fp32, round to the activation dtype,
multiply); `packed_linear` dispatches to it or, on CUDA, to the packed-weight kernel (and, opted
in, MXFP8 prefill products to FP8 activations: `use_w8a8`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from m3serve import envs
from m3serve.kernels.ref.packed import MX_BLOCK, NVFP4_BLOCK, dequantize, w8a8_reference

# From this many rows (tokens in a step) an MXFP8 product may take the W8A8 path (`use_w8a8`):
# prefill-sized products, where the FP8 tensor cores can pay for quantising the activations;
# below it the weight-only kernel's tuned decode tiles run.
W8A8_MIN_ROWS = 256


@dataclass(frozen=True)
class PackedFormat:
    """How one weight's codes and scales are laid out (see `kernels/ref/packed.py`)."""
    name: str                   # for messages and `m3serve plan`
    kind: str                   # mxfp8 | mxfp4 | nvfp4 (the dequantiser)
    block: int                  # elements per block scale, along K
    per_byte: int               # elements per code byte (1 or 2)
    code_dtype: torch.dtype
    scale_dtype: torch.dtype
    has_global: bool = False
    global_divides: bool = True  # NVFP4: compressed-tensors divides, ModelOpt multiplies


MXFP8 = PackedFormat("mxfp8", "mxfp8", MX_BLOCK, 1, torch.float8_e4m3fn, torch.uint8)
MXFP4 = PackedFormat("mxfp4", "mxfp4", MX_BLOCK, 2, torch.uint8, torch.uint8)
NVFP4 = PackedFormat("nvfp4", "nvfp4", NVFP4_BLOCK, 2, torch.uint8, torch.float8_e4m3fn,
                     has_global=True, global_divides=True)
NVFP4_MODELOPT = PackedFormat("nvfp4-modelopt", "nvfp4", NVFP4_BLOCK, 2, torch.uint8,
                              torch.float8_e4m3fn, has_global=True, global_divides=False)


def packed_format(module: nn.Module, attr: str) -> PackedFormat | None:
    # `packed` is a plain attribute (in the module's __dict__): reading it there keeps
    # nn.Module.__getattr__'s raise-and-catch off every forward of an unpacked model
    return module.__dict__.get("packed", {}).get(attr)


def _make(shape, dtype, like: nn.Parameter, k_div: int | None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=like.device), requires_grad=False)
    p.weight_loader, p.required_shards = like.weight_loader, like.required_shards
    p.k_div = k_div                  # None: one value per output row (a global scale)
    return p


def pack_param_(module: nn.Module, attr: str, fmt: PackedFormat, what: str, split: str = "") -> None:
    """Replace `module.<attr>` ([..., N, K_local], any device incl. meta) by its packed
    parameters, empty, with the same loader. `what` names the weight in errors; `split` says
    how K_local came about (e.g. "input size 96 over TP 2"), for the straddle error."""
    old = getattr(module, attr)
    *lead, n, k = old.shape
    check_blocks(k, fmt, what, split)
    setattr(module, attr, _make((*lead, n, k // fmt.per_byte), fmt.code_dtype, old, fmt.per_byte))
    setattr(module, attr + "_block_scale", _make((*lead, n, k // fmt.block), fmt.scale_dtype, old, fmt.block))
    if fmt.has_global:
        setattr(module, attr + "_global_scale", _make((*lead, n), torch.float32, old, None))
    module.packed = {**getattr(module, "packed", {}), attr: fmt}


def check_blocks(k: int, fmt: PackedFormat, what: str, split: str = "") -> None:
    """ValueError naming the numbers when this rank's reduction width `k` would cut a scale
    block in two (the block would straddle two ranks)."""
    if k % fmt.block:
        how = f" ({split})" if split else ""
        raise ValueError(f"{what}: {fmt.name} scale blocks of {fmt.block} along K would straddle "
                         f"the parallel shards: this rank's K is {k}{how}, not a multiple of {fmt.block}")


def split_note(module: nn.Module, attr: str) -> str:
    """How a weight's per-rank K came about, for `check_blocks`' message: a row-parallel
    layer's input or the experts' down projection split over ranks; "" when K is whole."""
    tp = getattr(module, "tp", None)
    if attr == "weight" and hasattr(module, "in_local") and tp is not None and tp.size > 1:
        return f"input size {module.in_local * tp.size} split over TP {tp.size}"
    if attr == "w2" and hasattr(module, "inter_local") and module.inter_local != module.inter:
        return f"intermediate_size {module.inter} split {module.inter // module.inter_local} ways"
    return ""


def set_packed_(module: nn.Module, attr: str, fmt: PackedFormat, codes: torch.Tensor,
                block_scale: torch.Tensor, global_scale: torch.Tensor | None = None) -> None:
    """Install already-quantised tensors as `module.<attr>` (online quantisation)."""
    setattr(module, attr, nn.Parameter(codes, requires_grad=False))
    setattr(module, attr + "_block_scale", nn.Parameter(block_scale, requires_grad=False))
    if fmt.has_global:
        setattr(module, attr + "_global_scale", nn.Parameter(global_scale, requires_grad=False))
    module.packed = {**getattr(module, "packed", {}), attr: fmt}


def dequantized(module: nn.Module, attr: str, dtype: torch.dtype, index=None) -> torch.Tensor:
    """The weight `module.<attr>` (or its row `index` of a stack) dequantised and rounded to
    `dtype`; a plain weight is returned as is."""
    fmt = packed_format(module, attr)
    w = getattr(module, attr)
    if fmt is None:
        return w if index is None else w[index]
    b = getattr(module, attr + "_block_scale")
    g = getattr(module, attr + "_global_scale", None) if fmt.has_global else None
    if index is not None:
        w, b, g = w[index], b[index], (None if g is None else g[index])
    return dequantize(fmt.kind, w, b, g, fmt.global_divides).to(dtype)


def dequantized_scratch(module: nn.Module, attr: str, dtype: torch.dtype) -> torch.Tensor:
    """`dequantized`'s values on the GPU, for the whole weight or stack of expert weights
    ([..., N, K]) at once: the packed-weight kernels' own tile loaders write it into a `dtype`
    scratch (long prefill products multiply it with the 16-bit kernels)."""
    from m3serve.kernels.packed_gemm import dequantize_weight
    fmt = packed_format(module, attr)
    codes, scale = getattr(module, attr), getattr(module, attr + "_block_scale")
    g = getattr(module, attr + "_global_scale") if fmt.has_global else None
    *lead, n, _ = codes.shape
    rows = n * (lead[0] if lead else 1)
    w = dequantize_weight(codes.reshape(rows, -1), scale.reshape(rows, -1),
                          None if g is None else g.reshape(rows), fmt.kind, dtype, fmt.global_divides)
    return w.view(*lead, n, -1)


def use_w8a8(x: torch.Tensor, fmt: PackedFormat) -> bool:
    """Whether this product quantises its activations to FP8 (W8A8): only with the opt-in
    M3SERVE_MXFP8_W8A8=1, only for MXFP8 weights, only from `W8A8_MIN_ROWS` rows (a step's
    tokens, so decode rows that share a step with a long prefill chunk get it too)."""
    return x.shape[0] >= W8A8_MIN_ROWS and fmt.kind == "mxfp8" and envs.MXFP8_W8A8


def w8a8_note(model: nn.Module) -> str | None:
    """What the W8A8 opt-in does to this model, for the start-up log; None when it is off."""
    if not envs.MXFP8_W8A8:
        return None
    n = sum(f.kind == "mxfp8" for m in model.modules() for f in m.__dict__.get("packed", {}).values())
    if not n:
        return "M3SERVE_MXFP8_W8A8=1 has no effect: this model has no MXFP8 weights"
    return (f"M3SERVE_MXFP8_W8A8=1: {n} MXFP8 weights multiply products of >= {W8A8_MIN_ROWS} rows "
            f"with FP8 activations (per-token e4m3, W8A8), not the default dequantised weight x "
            f"bf16 activation")


def packed_linear(x: torch.Tensor, module: nn.Module, attr: str = "weight") -> torch.Tensor:
    """x [T, K] @ dequant(module.<attr>)^T -> [T, N] in x's dtype: dequantised weight times the
    activation as it is (weight-only numerics, W8A16 / W4A16). On CUDA the codes are read by
    `kernels/packed_gemm.py` and dequantised in registers; the reference dequantises the whole
    weight first. With the W8A8 opt-in (`use_w8a8`) an MXFP8 product quantises each token of x
    to e4m3 first: `kernels/mxfp8_w8a8.py` on CUDA, `ref/packed.w8a8_reference` (in fp64,
    rounded once, like `linear`) on CPU; dispatch records it as "packed_linear_w8a8"."""
    from m3serve.layers.dispatch import executed, use_triton
    fmt = packed_format(module, attr)
    codes, scales = getattr(module, attr), getattr(module, attr + "_block_scale")
    triton_ok = use_triton("packed_linear", x)
    if use_w8a8(x, fmt):
        executed[("packed_linear_w8a8", "triton" if triton_ok else "reference")] += 1
        if triton_ok:
            from m3serve.kernels.mxfp8_w8a8 import mxfp8_w8a8_matmul
            return mxfp8_w8a8_matmul(x, codes, scales)
        return w8a8_reference(x, codes, scales, torch.float64).to(x.dtype)
    if triton_ok:
        from m3serve.kernels.packed_gemm import packed_matmul
        g = getattr(module, attr + "_global_scale") if fmt.has_global else None
        return packed_matmul(x, codes, scales, g, fmt.kind, fmt.global_divides)
    # a deliberate cycle inside layers/: linear.py routes packed weights here, and the
    # dequantised fallback is an ordinary linear
    from m3serve.layers.linear import linear
    return linear(x, dequantized(module, attr, x.dtype))


def row_fill(param: nn.Parameter, full: torch.Tensor, what: str) -> torch.Tensor:
    """A global-scale parameter's value from the checkpoint's one-element tensor, as fp32."""
    if full.numel() != 1 or full.dim() > 1:
        raise ValueError(f"shape mismatch for {what} global scale: checkpoint has "
                         f"{tuple(full.shape)}, expected one value")
    return full.reshape(()).float()


def is_row_scale(param: nn.Parameter) -> bool:
    return hasattr(param, "k_div") and param.k_div is None
