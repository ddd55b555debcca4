"""PyTorch twins of the RMSNorm kernels (CPU backend and test oracle): Gemma RMSNorm
(`x / rms(x) * (1 + w)`, fp32 inside, one cast out) and its fused residual-add form.

Residual rounding: the new residual is `bf16(x + residual)` (the sum formed in fp32, rounded once,
which is what a bf16 add does) and the norm reads that ROUNDED sum, so the fused op equals
`s = x + residual; gemma_rms_norm(s)` exactly (the HF order; vLLM normalises the unrounded sum,
a difference of at most one bf16 ulp of the sum, docs/model.md §3.2).
"""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N]; weight: [N] stored as an offset from 1. Returns [..., N] in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return y.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., N] same dtype. Returns (rms_norm(s), s), s = x + residual in x's dtype."""
    s = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(s, weight, eps), s
