"""SwiGLU-OAI: gate clamped above, up clamped both sides, `g * sigmoid(alpha g) * (u + 1)`."""
from __future__ import annotations

import torch

from m3serve.layers.dispatch import use_triton


def sigmoid_batch_invariant(x: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid whose value for an element does not depend on the tensor around it.
    torch's fp32 CPU sigmoid does: its vector loop and its scalar tail differ by an ulp, and
    where the tail falls depends on the tensor's size and on how `parallel_for` splits it over
    threads (chunks of a tensor over 32768 elements), i.e. on the rows batched beside a row
    and on the thread count. On CPU it is taken in fp64 and rounded once (the two fp64 paths
    differ far below an fp32 rounding); on the GPU it is the plain fp32 op."""
    if x.device.type == "cpu":
        return torch.sigmoid(x.double()).to(x.dtype)
    return torch.sigmoid(x)


def swiglu_oai_ref(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up: [..., 2I] with all gate columns first (not interleaved) -> [..., I], fp32 inside
    (the PyTorch reference op). On CPU the sigmoid runs in fp64 and rounds once
    (`sigmoid_batch_invariant`), so a row's result does not depend on the rows beside it."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (gate * sigmoid_batch_invariant(alpha * gate) * (up + 1.0)).to(gate_up.dtype)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`swiglu_oai_ref`'s result; on the GPU one Triton kernel for 2-D inputs, within one
    rounding of it (Triton's sigmoid takes another exp)."""
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and use_triton("swiglu", gate_up):
        from m3serve.kernels.swiglu import swiglu_oai_fused
        return swiglu_oai_fused(gate_up, alpha, limit)
    return swiglu_oai_ref(gate_up, alpha, limit)
