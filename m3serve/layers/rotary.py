"""Partial NeoX rotary embedding: the first `rotary_dim` channels of each head rotate.

cos/sin tables are computed from fp32 angles (fp32 position x fp32 inverse frequency, as both
references do) and rounded to the activation dtype before use.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from m3serve.layers.dispatch import use_triton


def yarn_inv_freq(rotary_dim: int, theta: float, yarn) -> torch.Tensor:
    """YaRN's inverse frequencies [rotary_dim / 2] (`model.config.YarnScaling`): dimension i
    blends the plain frequency (weight w_i) with the one interpolated by `factor` (1 - w_i);
    w_i ramps linearly from 1 to 0 between the dimensions whose wavelength fits `beta_fast` and
    `beta_slow` turns into the original context."""
    half = rotary_dim // 2
    plain = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))   # [half]

    def dim_of(turns: float) -> float:      # the dimension whose wavelength makes `turns` turns
        return rotary_dim * math.log(yarn.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = dim_of(yarn.beta_fast), dim_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(half, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp                       # weight of the plain (extrapolated) frequency
    return plain / yarn.factor * (1.0 - keep) + plain * keep


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, yarn=None):
        super().__init__()
        self.rotary_dim = rotary_dim
        if yarn is None:
            inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
            self.scale = 1.0
        else:
            inv, self.scale = yarn_inv_freq(rotary_dim, theta, yarn), float(yarn.attention_factor)
        self.register_buffer("inv_freq", inv, persistent=False)  # [rotary_dim / 2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: [T] -> cos, sin: [T, rotary_dim / 2] in `dtype` (YaRN: times its
        attention factor, as transformers applies it)."""
        half = self.inv_freq.shape[0]
        if positions.dim() == 1 and half & (half - 1) == 0 and use_triton("rope_cos_sin", positions):
            from m3serve.kernels.step_inputs import rope_cos_sin
            return rope_cos_sin(positions, self.inv_freq.to(positions.device), self.scale, dtype)
        angle = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        if self.scale == 1.0:
            return angle.cos().to(dtype), angle.sin().to(dtype)
        return (angle.cos() * self.scale).to(dtype), (angle.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, half]. Returns the rotated copy."""
    half = cos.shape[-1]
    a, b = x[..., :half], x[..., half:2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s, x[..., 2 * half:]], dim=-1)
