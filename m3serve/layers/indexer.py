"""MSA block selection (reference op): index scores against the paged index cache, token-causal,
max-pooled per block, forced init/local blocks, top-k per index head, -1 padded."""
from __future__ import annotations

import math

import torch

from m3serve.layers.attention_metadata import context_slots


def index_topk_ref(iq: torch.Tensor, index_cache: torch.Tensor, meta, topk: int, local_blocks: int,
                   init_blocks: int = 0) -> torch.Tensor:
    """iq: [T, Hi, Di] (normed, rotated); index_cache: [num_blocks, block_size, Di].

    Returns [T, Hi, topk] int64 logical block ids per query token and index head: forced blocks
    first, then by descending block score; unused slots -1. Scores are fp32 dot products.
    """
    T, Hi, _ = iq.shape
    bs = meta.block_size
    out = torch.full((T, Hi, topk), -1, dtype=torch.long, device=iq.device)
    flat = index_cache.reshape(-1, index_cache.shape[-1])
    # fp64 on CPU: per-query scores independent of how many queries share the call
    acc = torch.float64 if iq.device.type == "cpu" else torch.float32
    for r in range(meta.num_reqs):
        qs, qe = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1]
        if qe == qs:
            continue
        L = meta.seq_lens_cpu[r]
        n_blocks = -(-L // bs)
        keys = flat[context_slots(meta, r)].to(acc)                          # [L, Di]
        queries = iq[qs:qe]
        if index_cache.dtype == torch.float8_e4m3fn:                          # plain e4m3 cast, docs/model.md §4
            queries = queries.to(torch.float8_e4m3fn)
        q_pos = torch.arange(L - (qe - qs), L, device=iq.device)             # [Tq]
        scores = torch.einsum("thd,ld->thl", queries.to(acc), keys)           # [Tq, Hi, L]
        future = torch.arange(L, device=iq.device)[None, None, :] > q_pos[:, None, None]
        scores = scores.masked_fill(future, -math.inf)
        padded = torch.full((qe - qs, Hi, n_blocks * bs), -math.inf, dtype=acc, device=iq.device)
        padded[..., :L] = scores
        block_scores = padded.view(qe - qs, Hi, n_blocks, bs).amax(-1)       # [Tq, Hi, nb]
        own = q_pos // bs
        blocks = torch.arange(n_blocks, device=iq.device)
        forced = (blocks[None, :] <= own[:, None]) & (blocks[None, :] > own[:, None] - local_blocks)
        forced |= (blocks[None, :] < init_blocks) & (blocks[None, :] <= own[:, None])
        block_scores = block_scores.masked_fill(forced[:, None, :], math.inf)
        k = min(topk, n_blocks)
        vals, ids = torch.topk(block_scores, k, dim=-1)
        out[qs:qe, :, :k] = ids.masked_fill(vals == -math.inf, -1)
    return out
