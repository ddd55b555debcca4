"""PyTorch reference (and CPU backend) of the paged attention kernel, with the launcher's exact
signature: dense or MSA block-sparse causal attention over the paged K/V cache, bf16 or FP8 cache.
"""
from __future__ import annotations

import math

import torch

_MAX_SCORE_ELEMS = 1 << 26  # query chunking bound on the [chunk, H, L] fp32 score tensor


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                        block_ids: torch.Tensor | None = None, max_query_len: int, max_seq_len: int,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of `m3serve.kernels.paged_attention.paged_attention` (same contract).

    q: [T, H, D]; kv_cache: [2, num_blocks, block_size, G, D] in q's dtype or float8_e4m3fn (then
    value = stored * k_scale / v_scale); block_ids: None or [T, G, topk] logical block ids (-1
    padded). Softmax in fp32; a token that sees no key gets 0. max_query_len / max_seq_len are
    unused (kernel tuning hints). Returns out ([T, H, D], q's dtype).
    """
    T, H, D = q.shape
    bs, G = kv_cache.shape[2], kv_cache.shape[3]
    hpg = H // G
    if out is None:
        out = torch.empty_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    ks = k_scale.float() if kv_cache.dtype == torch.float8_e4m3fn else 1.0
    vs = v_scale.float() if kv_cache.dtype == torch.float8_e4m3fn else 1.0
    for r, L in enumerate(lens):
        qs, qe = qsl[r], qsl[r + 1]
        if qe == qs:
            continue
        key_pos = torch.arange(L, device=q.device)
        pages = block_tables[r, key_pos // bs].long()
        k = kv_cache[0, pages, key_pos % bs].float() * ks                     # [L, G, D]
        v = kv_cache[1, pages, key_pos % bs].float() * vs
        n_blocks = -(-L // bs)
        chunk = max(1, _MAX_SCORE_ELEMS // max(1, H * L))
        for c0 in range(qs, qe, chunk):
            c1 = min(qe, c0 + chunk)
            qc = q[c0:c1].float().view(c1 - c0, G, hpg, D)
            q_pos = torch.arange(c0 - qe + L, c1 - qe + L, device=q.device)   # [c]
            allowed = (key_pos[None, :] <= q_pos[:, None])[:, None, :]        # [c, 1, L]
            if block_ids is not None:
                sel = block_ids[c0:c1].long()                                 # [c, G, topk]
                sel = torch.where((sel >= 0) & (sel < n_blocks), sel, n_blocks)  # junk -> spare slot
                chosen = torch.zeros(c1 - c0, G, n_blocks + 1, dtype=torch.bool, device=q.device)
                chosen.scatter_(2, sel, True)
                allowed = allowed & chosen[:, :, key_pos // bs]               # [c, G, L]
            scores = torch.einsum("tgid,lgd->tgil", qc, k) * scale            # [c, G, hpg, L]
            scores = scores.masked_fill(~allowed[:, :, None, :], -math.inf)
            probs = torch.softmax(scores, -1).nan_to_num(0.0)                 # all-masked rows -> 0
            o = torch.einsum("tgil,lgd->tgid", probs, v)
            out[c0:c1] = o.reshape(c1 - c0, H, D).to(q.dtype)
    return out
