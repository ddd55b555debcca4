"""RMSNorm: the target's Gemma form (`y = x / rms(x) * (1 + w)`) and the standard form of the
EAGLE3 draft (`y = x / rms(x) * w`); fp32 inside, one cast out."""
from __future__ import annotations

import torch
from torch import nn

from m3serve.layers.linear import attach_loader, make_param, replicated_loader


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim], weight: [dim] stored as an offset from 1."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """`x / rms(x) * (1 + w)` (Gemma, the target's norms) or, with offset=False, `x / rms(x) * w`
    (standard, the EAGLE3 draft's)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, offset: bool = True):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = attach_loader(make_param((dim,), dtype), replicated_loader, [None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return gemma_rms_norm(x, self.weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)

