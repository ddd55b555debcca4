"""SwiGLU-OAI: gate clamped above, up clamped both sides, `g * sigmoid(alpha g) * (u + 1)`."""
from __future__ import annotations

import torch

from m3serve.layers.dispatch import use_triton


def swiglu_oai_ref(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up: [..., 2I] with all gate columns first (not interleaved) -> [..., I], fp32 inside
    (the PyTorch reference op)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (gate * torch.sigmoid(alpha * gate) * (up + 1.0)).to(gate_up.dtype)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`swiglu_oai_ref`'s result; on the GPU one Triton kernel for 2-D inputs, within one
    rounding of it (Triton's sigmoid takes another exp)."""
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and use_triton("swiglu", gate_up):
        from m3serve.kernels.swiglu import swiglu_oai_fused
        return swiglu_oai_fused(gate_up, alpha, limit)
    return swiglu_oai_ref(gate_up, alpha, limit)
