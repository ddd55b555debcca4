"""PyTorch twin of the MSA indexer top-k kernel (CPU backend and test oracle): fp32 index scores
of every query token against its request's paged index keys, token-causal, max per block, forced
local/init blocks, top-k LOGICAL block ids per index head, -1 padded."""
from __future__ import annotations

import math

import torch


def index_block_scores_ref(iq, index_cache, query_start_loc, seq_lens, block_tables, *,
                           block_size, local_blocks, init_blocks=0, max_seq_len):
    """Stage 1: fp32 block scores [T, Hi, ceil(max_seq_len / block_size)], +inf for forced
    blocks, -inf for blocks the token cannot see (see `kernels.indexer.index_block_scores`)."""
    T, Hi, Di = iq.shape
    dev = iq.device
    if index_cache.dtype == torch.float8_e4m3fn:  # fp8 index cache: queries cast to e4m3 too
        iq = iq.to(torch.float8_e4m3fn)
    max_blocks = -(-max_seq_len // block_size)
    out = torch.full((T, Hi, max_blocks), -math.inf, dtype=torch.float32, device=dev)
    flat = index_cache.reshape(-1, Di)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, L in enumerate(lens):
        qs, qe = qsl[r], qsl[r + 1]
        if qe == qs:
            continue
        if L > max_seq_len:
            raise ValueError(f"seq_lens[{r}] = {L} > max_seq_len = {max_seq_len}")
        n_blocks = -(-L // block_size)
        pos = torch.arange(L, device=dev)
        slots = block_tables[r, pos // block_size].long() * block_size + pos % block_size
        keys = flat[slots].float()                                            # [L, Di]
        q_pos = torch.arange(L - (qe - qs), L, device=dev)                    # [Tq]
        scores = torch.einsum("thd,ld->thl", iq[qs:qe].float(), keys)         # [Tq, Hi, L]
        scores = scores.masked_fill(pos[None, None, :] > q_pos[:, None, None], -math.inf)
        padded = torch.full((qe - qs, Hi, n_blocks * block_size), -math.inf, device=dev)
        padded[..., :L] = scores
        block_scores = padded.view(qe - qs, Hi, n_blocks, block_size).amax(-1)  # [Tq, Hi, nb]
        own = q_pos // block_size
        b = torch.arange(n_blocks, device=dev)[None, :]
        forced = (b <= own[:, None]) & ((b > own[:, None] - local_blocks) | (b < init_blocks))
        out[qs:qe, :, :n_blocks] = block_scores.masked_fill(forced[:, None, :], math.inf)
    return out


def index_topk_ref(iq, index_cache, query_start_loc, seq_lens, block_tables, *, block_size, topk,
                   local_blocks, init_blocks=0, max_seq_len, out=None):
    """See `m3serve.kernels.indexer.index_topk` for the contract. Returns [T, Hi, topk] int32."""
    scores = index_block_scores_ref(iq, index_cache, query_start_loc, seq_lens, block_tables,
                                    block_size=block_size, local_blocks=local_blocks,
                                    init_blocks=init_blocks, max_seq_len=max_seq_len)
    T, Hi, max_blocks = scores.shape
    res = torch.full((T, Hi, topk), -1, dtype=torch.int32, device=iq.device)
    k = min(topk, max_blocks)
    vals, ids = torch.topk(scores, k, dim=-1)
    res[..., :k] = ids.masked_fill(vals == -math.inf, -1).to(torch.int32)
    if out is not None:
        out.copy_(res)
        return out
    return res
