"""SwiGLU-OAI: gate clamped above, up clamped both sides, `g * sigmoid(alpha g) * (u + 1)`."""
from __future__ import annotations

import torch


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up: [..., 2I] with all gate columns first (not interleaved) -> [..., I], fp32 inside."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (gate * torch.sigmoid(alpha * gate) * (up + 1.0)).to(gate_up.dtype)
