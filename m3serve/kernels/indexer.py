"""Triton MSA indexer: block scores of index queries against the paged index cache (fp32 dot
products, token-causal, max per block, forced local/init blocks) and top-k LOGICAL block ids.

Stage 1 (Triton) writes fp32 block scores [T, Hi, max_blocks] (+inf forced, -inf invalid) into a
scratch buffer; stage 2 picks the top-k per row (a Triton row kernel while a row fits registers,
ties to the lower block id; torch.topk beyond), -inf picks becoming -1.
One program scores a tile of query tokens of ONE request (all Hi index heads, rows = token x head,
at least 16) over a range of blocks: each key tile [block_size, Di] is loaded once and used for
every row. Decode tiles have 16 rows; prefill tiles 64.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from m3serve.kernels.rmsnorm import interpreting

TARGET_PROGRAMS = 1024  # enough programs to fill 132 SMs several times over
MAX_BLOCKS_PER_PROG = 64
MAX_TRITON_TOPK_ROW = 16384  # blocks per row held in one program's registers (2M tokens)


@triton.jit
def _index_score_kernel(iq_ptr, cache_ptr, bt_ptr, tile_req_ptr, tile_tok_ptr, qsl_ptr, seq_ptr,
                        score_ptr, Hi, iq_s0, iq_s1, bt_s0, sc_s0, sc_s1, max_blocks,
                        blocks_per_prog, local_blocks, init_blocks,
                        BS: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
                        BLOCK_M: tl.constexpr, TPT: tl.constexpr, DOT_FP32: tl.constexpr,
                        IEEE: tl.constexpr):
    # rows = TPT query tokens x HP (padded) index heads, BLOCK_M = TPT * HP
    tile = tl.program_id(0)
    part = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    live = req >= 0                                   # tiles past the last request do nothing
    req = tl.maximum(req, 0)
    tok0 = tl.load(tile_tok_ptr + tile)
    q_end = tl.load(qsl_ptr + req + 1)
    L = tl.load(seq_ptr + req)

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // HP                           # [BLOCK_M] row = (token, head)
    head = rows % HP
    row_ok = (tok < q_end) & (head < Hi)
    pos = L - q_end + tok                             # absolute position of each row's token
    own = pos // BS
    d = tl.arange(0, DI)
    q = tl.load(iq_ptr + tok[:, None].to(tl.int64) * iq_s0 + head[:, None] * iq_s1 + d[None, :],
                mask=row_ok[:, None], other=0.0)      # [BLOCK_M, DI]
    if DOT_FP32:
        q = q.to(tl.float32)

    last_pos = L - q_end + tl.minimum(tok0 + TPT, q_end) - 1
    b0 = part * blocks_per_prog
    b1 = tl.minimum(b0 + blocks_per_prog, max_blocks)
    b1 = tl.where(live, b1, b0)
    b_seen = tl.maximum(tl.minimum(b1, last_pos // BS + 1), b0)  # later blocks: all -inf
    keys = tl.arange(0, BS)
    out_row = score_ptr + tok.to(tl.int64) * sc_s0 + head * sc_s1
    for b in range(b0, b_seen):
        page = tl.load(bt_ptr + req.to(tl.int64) * bt_s0 + b).to(tl.int64)
        k = tl.load(cache_ptr + page * (BS * DI) + keys[:, None] * DI + d[None, :])  # [BS, DI]
        if DOT_FP32:
            k = k.to(tl.float32)
        # keys as the M side (128 rows -> wgmma on Hopper), the few query rows as N
        if IEEE:
            s = tl.dot(k, tl.trans(q), input_precision="ieee")
        else:
            s = tl.dot(k, tl.trans(q))                # [BS, BLOCK_M] fp32 accumulate
        s = tl.where((b * BS + keys)[:, None] <= pos[None, :], s, -float("inf"))
        m = tl.max(s, axis=0)                         # [BLOCK_M]
        forced = (b <= own) & ((b > own - local_blocks) | (b < init_blocks))
        m = tl.where(forced, float("inf"), m)
        tl.store(out_row + b, m, mask=row_ok)
    neg = tl.full([BLOCK_M], -float("inf"), tl.float32)
    for b in range(b_seen, b1):
        tl.store(out_row + b, neg, mask=row_ok)


@triton.jit
def _topk_rows_kernel(score_ptr, out_ptr, ntok_ptr, Hi, n_cols, TOPK: tl.constexpr,
                      TOPK_P: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (token, head) row: TOPK passes of max + first-index argmax."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    n_read = tl.where(row // Hi < tl.load(ntok_ptr), n_cols, 0)  # padding tokens: all -1
    x = tl.load(score_ptr + row * n_cols + cols, mask=cols < n_read, other=-float("inf"))
    slots = tl.arange(0, TOPK_P)
    res = tl.full([TOPK_P], -1, tl.int32)
    for i in tl.static_range(TOPK):
        m, idx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        res = tl.where(slots == i, tl.where(m == -float("inf"), -1, idx), res)
        x = tl.where(cols == idx, -float("inf"), x)   # taken: never picked again as a valid id
    tl.store(out_ptr + row * TOPK + slots, res, mask=slots < TOPK)


def _tiles(query_start_loc: torch.Tensor, tokens_per_tile: int, T: int):
    """Per tile: owning request (-1 past the end) and first token, computed on the device.

    Tiles never straddle requests; their count is bounded by T // tpt + num_reqs."""
    R = query_start_loc.shape[0] - 1
    qsl = query_start_loc.long()
    n_t = (qsl[1:] - qsl[:-1] + tokens_per_tile - 1) // tokens_per_tile   # [R]
    cum = torch.cumsum(n_t, 0)
    max_tiles = T // tokens_per_tile + R
    i = torch.arange(max_tiles, device=qsl.device)
    req = torch.searchsorted(cum, i, right=True)
    rc = req.clamp(max=R - 1)
    tok0 = qsl[rc] + (i - (cum[rc] - n_t[rc])) * tokens_per_tile
    tile_req = torch.where(req < R, rc, -1).to(torch.int32)
    return tile_req, tok0.to(torch.int32), max_tiles


def index_block_scores(iq, index_cache, query_start_loc, seq_lens, block_tables, *, block_size,
                       local_blocks, init_blocks=0, max_seq_len):
    """Stage 1 alone: fp32 [T, Hi, ceil(max_seq_len / block_size)] block scores (+inf forced,
    -inf for blocks a token cannot see). Arguments as in `index_topk`."""
    T, Hi, Di = iq.shape
    if index_cache.dim() != 3 or index_cache.shape[1:] != (block_size, Di):
        raise ValueError(f"index_cache shape {tuple(index_cache.shape)} != "
                         f"[blocks, {block_size}, {Di}]")
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len = {max_seq_len} must be >= 1")
    if not index_cache.is_contiguous():
        raise ValueError("index_cache must be contiguous")
    if index_cache.dtype == torch.float8_e4m3fn:
        iq = iq.to(torch.float8_e4m3fn)  # spec §4: plain cast, no scale, e4m3 x e4m3 MMA
    elif iq.dtype != index_cache.dtype:
        raise ValueError(f"iq dtype {iq.dtype} != index_cache dtype {index_cache.dtype}")
    if iq.stride(-1) != 1:
        iq = iq.contiguous()
    max_blocks = -(-max_seq_len // block_size)
    scores = torch.empty((T, Hi, max_blocks), dtype=torch.float32, device=iq.device)
    R = seq_lens.shape[0]
    if T == 0 or R == 0:
        return scores
    HP = triton.next_power_of_2(Hi)
    decode = T == R  # one token per request: smallest tile
    BLOCK_M = max(16, HP) if decode else max(64, HP)
    tile_req, tile_tok, n_tiles = _tiles(query_start_loc, BLOCK_M // HP, T)
    bpp = max(1, min(MAX_BLOCKS_PER_PROG, math.ceil(n_tiles * max_blocks / TARGET_PROGRAMS)))
    interp = interpreting()
    grid = (n_tiles, triton.cdiv(max_blocks, bpp))
    _index_score_kernel[grid](
        iq, index_cache, block_tables, tile_req, tile_tok, query_start_loc, seq_lens, scores,
        Hi, iq.stride(0), iq.stride(1), block_tables.stride(0), scores.stride(0),
        scores.stride(1), max_blocks, bpp, local_blocks, init_blocks,
        BS=block_size, DI=Di, HP=HP, BLOCK_M=BLOCK_M, TPT=BLOCK_M // HP,
        DOT_FP32=interp or iq.dtype == torch.float32,
        IEEE=(not interp) and iq.dtype == torch.float32,
        num_warps=4, num_stages=3)
    return scores


def index_topk(iq, index_cache, query_start_loc, seq_lens, block_tables, *, block_size, topk,
               local_blocks, init_blocks=0, max_seq_len, out=None):
    """MSA block selection for a flattened batch.

    iq: [T, Hi, Di] index queries (normed + rotated, activation dtype); index_cache:
    [num_blocks, block_size, Di] (bf16/fp16/fp32, or float8_e4m3fn: then iq is cast to e4m3,
    no scales); query_start_loc: [R + 1] int32 (request r owns tokens qsl[r]:qsl[r+1], the last
    tokens of its context); seq_lens: [R] int32; block_tables: [R, >= max_seq_len / block_size]
    int32 (logical block -> page). max_seq_len: host int >= every seq_len (sizes the scratch).

    Returns [T, Hi, topk] int32 LOGICAL block ids (into `out` when given): forced blocks (own
    block and the local_blocks - 1 before it, blocks < init_blocks) first, then by descending
    block max of the fp32 scores; each block at most once; -1 padded past the valid blocks.
    """
    scores = index_block_scores(iq, index_cache, query_start_loc, seq_lens, block_tables,
                                block_size=block_size, local_blocks=local_blocks,
                                init_blocks=init_blocks, max_seq_len=max_seq_len)
    return select_topk(scores, topk, out, num_tokens=query_start_loc[-1:])


def select_topk(scores: torch.Tensor, topk: int, out: torch.Tensor | None = None, *,
                num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 2: scores [T, Hi, n] fp32 -> [T, Hi, topk] int32 column ids in descending score
    order (equal scores: lower id first on the Triton path), -1 for -inf picks and past n.
    num_tokens: optional [1] int device tensor; rows of tokens >= it (batch padding, whose
    scores stage 1 never wrote) come out all -1."""
    T, Hi, max_blocks = scores.shape
    if out is None:
        out = torch.empty((T, Hi, topk), dtype=torch.int32, device=scores.device)
    elif out.shape != (T, Hi, topk) or out.dtype != torch.int32:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} != [{T}, {Hi}, {topk}] int32")
    if T == 0:
        return out
    if num_tokens is None:
        num_tokens = torch.full((1,), T, dtype=torch.int32, device=scores.device)
    if max_blocks <= MAX_TRITON_TOPK_ROW and out.is_contiguous() and scores.is_contiguous():
        BLOCK = triton.next_power_of_2(max_blocks)
        _topk_rows_kernel[(T * Hi,)](scores, out, num_tokens, Hi, max_blocks, TOPK=topk,
                                     TOPK_P=triton.next_power_of_2(topk), BLOCK=BLOCK,
                                     num_warps=4 if BLOCK <= 2048 else 8)
        return out
    k = min(topk, max_blocks)
    vals, ids = torch.topk(scores, k, dim=-1)
    pad = torch.arange(T, device=scores.device)[:, None, None] >= num_tokens
    out[..., :k] = ids.masked_fill((vals == -math.inf) | pad, -1)
    out[..., k:] = -1
    return out
