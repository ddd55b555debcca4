"""Online FP8 quantisation (`--quantization fp8`, per-token activation / per-channel weight,
docs/model.md §8.3): each weight is quantised once, as the loader completes it; activations per call.

GEMMs run through `torch._scaled_mm` with row-wise scales on the GPU (opt-in, M3SERVE_FP8_DECODE_GEMM=1:
decode and verify rows of a TP rank's narrow weights through the split-K FP8 GEMM of
`kernels/fp8_decode.py`, the same quantised operands); the CPU reference dequantises both
operands and multiplies in fp64 (same products, one rounding).
Kept in bf16 (the default exclusions): embeddings, lm_head, the router, all norms.
"""
from __future__ import annotations

import torch
from torch import nn

from m3serve import envs
from m3serve.layers.dispatch import use_triton

FP8 = torch.float8_e4m3fn


_QUANT_CHUNK_ELEMS = 1 << 27   # fp32 temporaries of at most 512 MiB while quantising


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (e4m3 [..., N, K], fp32 scale [..., N]); W ~= Wq * scale. Rows are
    quantised independently, in chunks, so a whole expert stack never exists in fp32."""
    from m3serve.kernels.ref.fused_moe import quant_weight_fp8
    rows = w.reshape(-1, w.shape[-1])
    q = torch.empty(rows.shape, dtype=FP8, device=w.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=w.device)
    step = max(1, _QUANT_CHUNK_ELEMS // max(1, rows.shape[1]))
    for i in range(0, rows.shape[0], step):
        q[i:i + step], scale[i:i + step] = quant_weight_fp8(rows[i:i + step])
    return q.view(w.shape), scale.view(w.shape[:-1])


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantisation: x [T, K] -> (e4m3 [T, K], fp32 scale [T])."""
    if x.is_cuda:
        from m3serve.kernels.fused_moe import quant_rows_fp8
        return quant_rows_fp8(x)
    from m3serve.kernels.ref.fused_moe import quant_rows_fp8_ref
    return quant_rows_fp8_ref(x)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               x_quant: tuple | None = None) -> torch.Tensor:
    """x [T, K] (bf16) @ dequant(wq [N, K])^T with per-token activation quantisation -> [T, N].
    `x_quant`: x [T, K]'s per-token FP8 form (e4m3, fp32 scale [T]) as `quantize_rows` makes it,
    when the caller has it (the norm before: one launch fewer)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x.is_cuda and envs.FP8_DECODE_GEMM:
        from m3serve.kernels.fp8_decode import fp8_decode_chosen, fp8_decode_linear
        if fp8_decode_chosen(x2, wq) and use_triton("fp8_decode_gemm", x2):
            return fp8_decode_linear(x2, wq, w_scale, x_quant=x_quant).reshape(*shape[:-1], wq.shape[0])
    xq, x_scale = x_quant if x_quant is not None else quantize_rows(x2)
    if x.is_cuda:
        y = torch._scaled_mm(xq, wq.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :],
                             out_dtype=x.dtype)
    else:
        y = ((xq.double() * x_scale.double()[:, None]) @ (wq.double() * w_scale.double()[:, None]).t()).to(x.dtype)
    return y.reshape(*shape[:-1], wq.shape[0])


def quantize_linear_(module: nn.Module) -> None:
    """Replace `module.weight` by its FP8 form and add `module.weight_scale` [N] fp32."""
    wq, scale = quantize_weight(module.weight.data)
    module.weight = nn.Parameter(wq, requires_grad=False)
    module.weight_scale = scale
