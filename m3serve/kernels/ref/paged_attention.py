"""PyTorch reference of the paged attention kernel, with the launcher's exact signature: dense
or MSA block-sparse causal attention over the paged K/V cache, bf16 or FP8 cache. It is the one
CPU implementation of the op (the attention layer's and the EAGLE3 draft's CPU path) and the
GPU kernel's test oracle.

Accumulation: fp64 on CPU, so a query's result does not depend on how many queries share the
call (chunked prefill, batching and prefix hits stay bit-identical); fp32 on other devices.
"""
from __future__ import annotations

import math

import torch

_MAX_SCORE_BYTES = 1 << 28  # query chunking bound on the [chunk, H, L] score tensor


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                        block_ids: torch.Tensor | None = None, max_query_len: int, max_seq_len: int,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, key_lo: torch.Tensor | None = None,
                        num_splits: int | None = None) -> torch.Tensor:
    """Reference of `m3serve.kernels.paged_attention.paged_attention` (same contract).

    q: [T, H, D]; kv_cache: [2, num_blocks, block_size, G, D] in q's dtype or float8_e4m3fn (then
    value = stored * k_scale / v_scale); block_ids: None or [T, G, topk] logical block ids (-1
    padded; ids outside the context are ignored). Request r's queries are the last tokens of its
    context of seq_lens[r]; each sees the keys at positions <= its own, and with `key_lo` ([T]
    int, a sliding window's left edge per token) only those at positions >= key_lo[t]. A token
    that sees no key gets 0. max_query_len / max_seq_len / num_splits are unused (kernel tuning
    hints; the kernel takes key_lo only with max_query_len <= TOKEN_KERNEL_MAX_QUERY, the
    reference with any).
    Returns out ([T, H, D], q's dtype).
    """
    T, H, D = q.shape
    bs, G = kv_cache.shape[2], kv_cache.shape[3]
    hpg = H // G
    acc = torch.float64 if q.device.type == "cpu" else torch.float32
    if out is None:
        out = torch.empty_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    group_of_head = torch.arange(H, device=q.device) // hpg
    for r, L in enumerate(lens):
        qs, qe = qsl[r], qsl[r + 1]
        if qe == qs:
            continue
        key_pos = torch.arange(L, device=q.device)
        pages = block_tables[r, key_pos // bs].long()
        k = kv_cache[0, pages, key_pos % bs].to(acc)                          # [L, G, D]
        v = kv_cache[1, pages, key_pos % bs].to(acc)
        if fp8:
            k, v = k * k_scale.to(acc), v * v_scale.to(acc)
        k, v = k[:, group_of_head], v[:, group_of_head]                       # [L, H, D]
        n_blocks = -(-L // bs)
        chunk = max(1, _MAX_SCORE_BYTES // (H * L * (torch.finfo(acc).bits // 8)))
        for c0 in range(qs, qe, chunk):
            c1 = min(qe, c0 + chunk)
            q_pos = torch.arange(c0 - qe + L, c1 - qe + L, device=q.device)   # [c]
            allowed = key_pos[None, :] <= q_pos[:, None]                      # [c, L]
            if key_lo is not None:
                allowed = allowed & (key_pos[None, :] >= key_lo[c0:c1, None])
            allowed = allowed[:, None, :]                                     # [c, 1, L]
            if block_ids is not None:
                sel = block_ids[c0:c1].long()                                 # [c, G, topk]
                sel = torch.where((sel >= 0) & (sel < n_blocks), sel, n_blocks)  # junk -> spare slot
                chosen = torch.zeros(c1 - c0, G, n_blocks + 1, dtype=torch.bool, device=q.device)
                chosen.scatter_(2, sel, True)
                allowed = allowed & chosen[:, :, key_pos // bs][:, group_of_head]  # [c, H, L]
            scores = torch.einsum("thd,lhd->thl", q[c0:c1].to(acc), k) * scale
            scores = scores.masked_fill(~allowed, -math.inf)
            probs = torch.softmax(scores, -1).nan_to_num(0.0)                 # all-masked rows -> 0
            out[c0:c1] = torch.einsum("thl,lhd->thd", probs, v).to(q.dtype)
    return out
