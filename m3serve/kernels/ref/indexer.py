"""PyTorch reference of the MSA indexer top-k kernel, with the launchers' signatures: index
scores of every query token against its request's paged index keys, token-causal, max per
block, forced local/init blocks, top-k LOGICAL block ids per index head, -1 padded. It is the
one CPU implementation of the op (the sparse attention layer's CPU path) and the GPU kernel's
test oracle.

Accumulation: fp64 on CPU, so a query's scores (and so its choice) do not depend on how many
queries share the call; fp32 on other devices.
"""
from __future__ import annotations

import math

import torch


def _request_scores(iq, flat, block_tables, r: int, qs: int, qe: int, L: int, max_seq_len: int,
                    block_size: int, local_blocks: int, init_blocks: int) -> torch.Tensor:
    """Block scores [qe - qs, Hi, ceil(L / block_size)] of request r's queries (accumulation
    dtype): +inf for forced blocks, -inf for blocks the token cannot see."""
    if L > max_seq_len:
        raise ValueError(f"seq_lens[{r}] = {L} > max_seq_len = {max_seq_len}")
    dev = iq.device
    acc = torch.float64 if dev.type == "cpu" else torch.float32
    Hi = iq.shape[1]
    n_blocks = -(-L // block_size)
    pos = torch.arange(L, device=dev)
    slots = block_tables[r, pos // block_size].long() * block_size + pos % block_size
    keys = flat[slots].to(acc)                                                # [L, Di]
    queries = iq[qs:qe]
    if flat.dtype == torch.float8_e4m3fn:  # fp8 index cache: plain e4m3 cast of the queries too
        queries = queries.to(torch.float8_e4m3fn)
    q_pos = torch.arange(L - (qe - qs), L, device=dev)                        # [Tq]
    scores = torch.einsum("thd,ld->thl", queries.to(acc), keys)               # [Tq, Hi, L]
    scores = scores.masked_fill(pos[None, None, :] > q_pos[:, None, None], -math.inf)
    padded = torch.full((qe - qs, Hi, n_blocks * block_size), -math.inf, dtype=acc, device=dev)
    padded[..., :L] = scores
    block_scores = padded.view(qe - qs, Hi, n_blocks, block_size).amax(-1)    # [Tq, Hi, nb]
    own = q_pos // block_size
    b = torch.arange(n_blocks, device=dev)[None, :]
    forced = (b <= own[:, None]) & ((b > own[:, None] - local_blocks) | (b < init_blocks))
    return block_scores.masked_fill(forced[:, None, :], math.inf)


def _requests(query_start_loc, seq_lens):
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, L in enumerate(lens):
        if qsl[r + 1] > qsl[r]:
            yield r, qsl[r], qsl[r + 1], L


def index_block_scores_ref(iq, index_cache, query_start_loc, seq_lens, block_tables, *,
                           block_size, local_blocks, init_blocks=0, max_seq_len, max_query_len=None):
    """Stage 1: fp32 block scores [T, Hi, ceil(max_seq_len / block_size)], +inf for forced
    blocks, -inf for blocks the token cannot see (see `kernels.indexer.index_block_scores`)."""
    T, Hi, Di = iq.shape
    out = torch.full((T, Hi, -(-max_seq_len // block_size)), -math.inf, dtype=torch.float32,
                     device=iq.device)
    flat = index_cache.reshape(-1, Di)
    for r, qs, qe, L in _requests(query_start_loc, seq_lens):
        s = _request_scores(iq, flat, block_tables, r, qs, qe, L, max_seq_len, block_size,
                            local_blocks, init_blocks)
        out[qs:qe, :, :s.shape[-1]] = s.float()
    return out


def index_topk_ref(iq, index_cache, query_start_loc, seq_lens, block_tables, *, block_size, topk,
                   local_blocks, init_blocks=0, max_seq_len, max_query_len=None, out=None):
    """See `m3serve.kernels.indexer.index_topk` for the contract. Returns [T, Hi, topk] int32:
    forced blocks, then by descending score (ties among forced blocks in any order), -1 padded.
    """
    T, Hi, Di = iq.shape
    res = torch.full((T, Hi, topk), -1, dtype=torch.int32, device=iq.device)
    flat = index_cache.reshape(-1, Di)
    for r, qs, qe, L in _requests(query_start_loc, seq_lens):
        s = _request_scores(iq, flat, block_tables, r, qs, qe, L, max_seq_len, block_size,
                            local_blocks, init_blocks)
        k = min(topk, s.shape[-1])
        vals, ids = torch.topk(s, k, dim=-1)
        res[qs:qe, :, :k] = ids.masked_fill(vals == -math.inf, -1).to(torch.int32)
    if out is not None:
        out.copy_(res)
        return out
    return res
