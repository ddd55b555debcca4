"""SwiGLU-OAI in one pass: h = min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u) + 1)
over [T, 2I] gate|up rows (gate columns first), fp32 inside, one rounding to the output dtype.
The PyTorch op it replaces (`layers/activation.py`) runs eight elementwise kernels."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.pdl import enabled as pdl_enabled
from m3serve.kernels.pdl import launch_options, pdl_start
from m3serve.kernels.rmsnorm import cast_rne, interpreting


@triton.jit
def _swiglu_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, alpha, limit,
                   BLOCK: tl.constexpr, EMULATE: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.clamp(u, -limit, limit)
    h = g * tl.sigmoid(alpha * g) * (u + 1.0)
    tl.store(out_ptr + row * stride_o + cols, cast_rne(h, out_ptr.dtype.element_ty, EMULATE), mask=ok)


def swiglu_oai_fused(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up: [T, 2I] (unit last stride) -> [T, I] in its dtype."""
    T, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with a unit last stride, got {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    pdl = pdl_enabled(gate_up)
    _swiglu_kernel[(T, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                   alpha, limit, BLOCK=block, EMULATE=interpreting(),
                                                   PDL=pdl, num_warps=4, **launch_options(pdl))
    return out
