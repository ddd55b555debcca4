"""Triton split + 3-D RoPE of the vision encoder's fused QKV product, in one launch: from
qkv [n, 3 * heads * head_dim] to q and k rotated and v, each [n, heads, head_dim] contiguous
(the layout the variable-length flash attention reads). Replaces about twenty small torch ops
per layer (the slices, products, sums and concatenations of `layers.rotary.apply_rotary`, and
the copy that makes v contiguous).

Rounding matches `apply_rotary` in the activation dtype: each product rounded, then the sum
or difference rounded; channels past 2 x half pass through. Grid: one program per patch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.rmsnorm import cast_rne, interpreting


@triton.jit
def _vision_qkv_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, qkv_row, cs_row,
                            HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = (heads < HEADS)[:, None] & (cols < D)[None, :]
    offs = heads[:, None] * D + cols[None, :]                               # [BLOCK_H, BLOCK_D]
    src = qkv_ptr + row * qkv_row
    dst = row * (HEADS * D)
    rot = cols < 2 * HALF
    hc = tl.where(cols < HALF, cols, cols - HALF)
    c = tl.load(cos_ptr + row * cs_row + hc, mask=rot, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + row * cs_row + hc, mask=rot, other=0.0).to(tl.float32)[None, :]
    # NeoX partner channel: c <-> c ± HALF inside the rotary part
    pcols = tl.where(cols < HALF, cols + HALF, tl.where(rot, cols - HALF, cols))
    poffs = heads[:, None] * D + pcols[None, :]
    for part in tl.static_range(2):                                         # q, then k
        base = src + part * (HEADS * D)
        x = tl.load(base + offs, mask=mask, other=0.0)
        dt = x.dtype
        xp = tl.load(base + poffs, mask=mask, other=0.0)
        xc = cast_rne(x.to(tl.float32) * c, dt, EMULATE).to(tl.float32)
        xs = cast_rne(xp.to(tl.float32) * s, dt, EMULATE).to(tl.float32)
        lo = cast_rne(xc - xs, dt, EMULATE)
        hi = cast_rne(xc + xs, dt, EMULATE)
        out = tl.where((cols < HALF)[None, :], lo, tl.where(rot[None, :], hi, x))
        if part == 0:
            tl.store(q_ptr + dst + offs, out, mask=mask)
        else:
            tl.store(k_ptr + dst + offs, out, mask=mask)
    v = tl.load(src + 2 * (HEADS * D) + offs, mask=mask, other=0.0)
    tl.store(v_ptr + dst + offs, v, mask=mask)


def vision_qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int):
    """qkv [n, 3 * heads * head_dim] (rows may be strided, columns contiguous), cos / sin
    [n, half] -> (q, k, v), each [n, heads, head_dim] contiguous, q and k rotated (NeoX halves
    over the first 2 * half channels) as `layers.rotary.apply_rotary` rotates them."""
    n, width = qkv.shape
    head_dim = width // (3 * heads)
    half = cos.shape[-1]
    if width != 3 * heads * head_dim or qkv.stride(1) != 1 or 2 * half > head_dim:
        raise ValueError(f"vision_qkv_rope: qkv {tuple(qkv.shape)} is not [n, 3 x {heads} heads x head_dim] "
                         f"with contiguous columns, or the rotary half {half} exceeds head_dim / 2")
    cos, sin = cos.contiguous(), sin.contiguous()
    q, k, v = (torch.empty(n, heads, head_dim, dtype=qkv.dtype, device=qkv.device) for _ in range(3))
    if n:
        _vision_qkv_rope_kernel[(n,)](
            qkv, cos, sin, q, k, v, qkv.stride(0), cos.stride(0), HEADS=heads, D=head_dim, HALF=half,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim),
            EMULATE=interpreting(), num_warps=4)
    return q, k, v
