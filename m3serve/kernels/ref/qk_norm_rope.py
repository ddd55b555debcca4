"""PyTorch twin of the fused q/k norm + partial NeoX RoPE + cache-write kernel (CPU backend and
test oracle). Same math and rounding order as the attention layer: Gemma RMSNorm in fp32 cast to
the activation dtype, then RoPE in that dtype, then K/V/index-K written to the paged caches.
"""
from __future__ import annotations

import torch


def _gemma_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())
    return y.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, half] -> rotated copy (first 2*half channels, NeoX pairs)."""
    half = cos.shape[-1]
    a, b = x[..., :half], x[..., half:2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s, x[..., 2 * half:]], dim=-1)


def write_slots_ref(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor,
                    scale=None) -> None:
    """cache: [num_blocks, block_size, *rest]; values: [T, *rest]; slots < 0 skipped.
    With a scale (fp32 tensor or host float) the stored value is `dtype(fp32(value) / fp32(scale))`
    by IEEE division (fp8 caches): a float scale becomes a device tensor first, since torch
    multiplies by the reciprocal when dividing a CUDA tensor by a host scalar."""
    flat = cache.view(-1, *cache.shape[2:])
    keep = slot_mapping >= 0
    vals = values[keep]
    if scale is not None:
        if not isinstance(scale, torch.Tensor):
            scale = torch.full((1,), float(scale), dtype=torch.float32, device=vals.device)
        vals = vals.float() / scale.reshape(1).to(vals.device)
    flat[slot_mapping[keep]] = vals.to(cache.dtype)


def qk_norm_rope_cache_ref(q, k, v, iq, ik, q_norm_w, k_norm_w, iq_norm_w, ik_norm_w, cos, sin,
                           kv_cache, index_cache, slot_mapping, eps, *, k_scale=None, v_scale=None):
    """See `m3serve.kernels.qk_norm_rope.qk_norm_rope_cache` for the contract."""
    T = q.shape[0]
    qo = _rope(_gemma_norm(q, q_norm_w, eps), cos, sin)
    ko = _rope(_gemma_norm(k, k_norm_w, eps), cos, sin)
    write_slots_ref(kv_cache[0], ko, slot_mapping, k_scale)
    write_slots_ref(kv_cache[1], v, slot_mapping, v_scale)
    if iq is None:
        return qo.contiguous(), None
    Di = iq.shape[-1]
    iqo = _rope(_gemma_norm(iq, iq_norm_w, eps), cos, sin)
    iko = _rope(_gemma_norm(ik.reshape(T, 1, Di), ik_norm_w, eps), cos, sin)
    write_slots_ref(index_cache, iko[:, 0], slot_mapping)
    return qo.contiguous(), iqo.contiguous()
