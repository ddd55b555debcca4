"""Partial NeoX rotary embedding: the first `rotary_dim` channels of each head rotate.

cos/sin tables are computed from fp32 angles (fp32 position x fp32 inverse frequency, as both
references do) and rounded to the activation dtype before use.
"""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv, persistent=False)  # [rotary_dim / 2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: [T] -> cos, sin: [T, rotary_dim / 2] in `dtype`."""
        angle = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return angle.cos().to(dtype), angle.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, half]. Returns the rotated copy."""
    half = cos.shape[-1]
    a, b = x[..., :half], x[..., half:2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s, x[..., 2 * half:]], dim=-1)
