"""Triton MSA indexer: block scores of index queries against the paged index cache (fp32 dot
products, token-causal, max per block, forced local/init blocks) and top-k LOGICAL block ids.

Stage 1 scores a tile of query tokens of ONE request (all Hi index heads, rows = token x head, at
least 16) against key blocks; each key tile [block_size, Di] is loaded once for every row. The
tile -> (request, first token) map is computed inside the kernel; the blocks of a tile are dealt
round-robin to the programs of grid axis 1, so work follows the real context length, not the
host bound max_seq_len. Stage 2 picks the top-k per (token, head) row over the row's visible
blocks only. No host sync, no data-dependent shapes: both launchers are CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.pdl import enabled as pdl_enabled
from m3serve.kernels.pdl import launch_options, pdl_start
from m3serve.kernels.rmsnorm import cast_rne, interpreting

TARGET_PROGRAMS = 1024  # stage-1 programs per launch: 132 SMs x several, balanced round-robin
TOPK_CHUNK = 4096       # stage-2 columns per register chunk (512K tokens of 128-token blocks)
TOPK_MIN_COLUMNS = 128  # the narrowest column bucket of stage 2 (contexts up to 16K tokens)
# Warps of a top-k program whose row fits one chunk of <= 128 columns (contexts up to 16K
# tokens): one warp reduces with shuffles alone (16 of 74 on an H200: 3.1 µs, 4 warps 4.6).
TOPK_WARPS_SMALL = 1


def _topk_warps(chunk: int) -> int:
    return TOPK_WARPS_SMALL if chunk <= 128 else (4 if chunk <= 1024 else 8)


@triton.jit
def _tile_of(tile, qsl_ptr, R, TPR, TPT: tl.constexpr, R_P: tl.constexpr, DIRECT: tl.constexpr):
    """(request, first token, tile exists) of a query tile. DIRECT: tile = r * TPR + j covers
    tokens j*TPT.. of request r (needs TPR * TPT >= every q_len). Otherwise tiles are packed
    request after request: an in-register prefix sum of per-request tile counts."""
    if DIRECT:
        req = tile // TPR
        live = req < R
        req = tl.minimum(req, R - 1)
        tok0 = tl.load(qsl_ptr + req) + (tile % TPR) * TPT
    else:
        r = tl.arange(0, R_P)
        lo = tl.load(qsl_ptr + r, mask=r < R, other=0)
        hi = tl.load(qsl_ptr + r + 1, mask=r < R, other=0)
        n_t = (hi - lo + TPT - 1) // TPT                             # [R_P] tiles per request
        cum = tl.cumsum(n_t, axis=0)
        req = tl.sum((cum <= tile).to(tl.int32), axis=0)             # first r with cum[r] > tile
        live = req < R
        req = tl.minimum(req, R - 1)
        before = tl.sum(tl.where(r < req, n_t, 0), axis=0)
        tok0 = tl.load(qsl_ptr + req) + (tile - before) * TPT
    return req, tok0, live


# sizes that change from step to step are not specialised on (no recompiles mid-serving)
@triton.jit(do_not_specialize=["R", "TPR", "bt_s0", "max_blocks", "sc_s0", "sc_s1"])
def _index_score_kernel(iq_ptr, cache_ptr, bt_ptr, qsl_ptr, seq_ptr, score_ptr, nvis_ptr,
                        R, TPR, Hi, iq_s0, iq_s1, bt_s0, sc_s0, sc_s1, max_blocks,
                        local_blocks, init_blocks,
                        BS: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
                        BLOCK_M: tl.constexpr, TPT: tl.constexpr, R_P: tl.constexpr,
                        DIRECT: tl.constexpr, Q_FP8: tl.constexpr,
                        DOT_FP32: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_start(PDL)
    # rows = TPT query tokens x HP (padded) index heads, BLOCK_M = TPT * HP
    tile = tl.program_id(0)
    part = tl.program_id(1)
    n_parts = tl.num_programs(1)
    req, tok0, live = _tile_of(tile, qsl_ptr, R, TPR, TPT, R_P, DIRECT)
    q_end = tl.load(qsl_ptr + req + 1)
    L = tl.load(seq_ptr + req)
    live = live & (tok0 < q_end)
    tok_end = tl.where(live, q_end, tok0)             # scalar conditions folded into bounds:
                                                      # the interpreter rejects bool & scalar masks
    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // HP                           # [BLOCK_M] row = (token, head)
    head = rows % HP
    row_ok = (tok < tok_end) & (head < Hi)
    pos = L - q_end + tok                             # absolute position of each row's token
    own = pos // BS
    # visible blocks per token (own block + earlier ones): the top-k reads only those columns;
    # written once, by the part-0 program's head-0 rows
    tl.store(nvis_ptr + tok, tl.minimum(own + 1, max_blocks),
             mask=(tok < tok_end) & ((head + part) == 0))
    last_pos = L - q_end + tl.minimum(tok0 + TPT, q_end) - 1
    n_seen = tl.where(live, tl.minimum(last_pos // BS + 1, max_blocks), 0)
    if part < n_seen:
        d = tl.arange(0, DI)
        q = tl.load(iq_ptr + tok[:, None].to(tl.int64) * iq_s0 + head[:, None] * iq_s1
                    + d[None, :], mask=row_ok[:, None], other=0.0)        # [BLOCK_M, DI]
        if Q_FP8:  # fp8 index cache: queries plain-cast to e4m3 (docs/model.md §4), e4m3 x e4m3 MMA
            q = cast_rne(q.to(tl.float32), tl.float8e4nv, EMULATE)
        if DOT_FP32:
            q = q.to(tl.float32)
        keys = tl.arange(0, BS)
        out_row = score_ptr + tok.to(tl.int64) * sc_s0 + head * sc_s1
        for b in range(part, n_seen, n_parts):
            page = tl.load(bt_ptr + req.to(tl.int64) * bt_s0 + b).to(tl.int64)
            k = tl.load(cache_ptr + page * (BS * DI) + keys[:, None] * DI + d[None, :])  # [BS, DI]
            if DOT_FP32:
                k = k.to(tl.float32)
            # keys as the M side (128 rows -> wgmma on Hopper), the few query rows as N
            if IEEE:
                s = tl.dot(k, tl.trans(q), input_precision="ieee")
            else:
                s = tl.dot(k, tl.trans(q))            # [BS, BLOCK_M] fp32 accumulate
            s = tl.where((b * BS + keys)[:, None] <= pos[None, :], s, -float("inf"))
            m = tl.max(s, axis=0)                     # [BLOCK_M]
            forced = (b <= own) & ((b > own - local_blocks) | (b < init_blocks))
            m = tl.where(forced, float("inf"), m)
            tl.store(out_row + b, m, mask=row_ok)


# sizes that change from step to step are not specialised on (no recompiles mid-serving)
@triton.jit(do_not_specialize=["n_cols"])
def _topk_rows_kernel(score_ptr, out_ptr, ntok_ptr, ntok_idx, nvis_ptr, Hi, n_cols,
                      TOPK: tl.constexpr, TOPK_P: tl.constexpr, CHUNK: tl.constexpr,
                      ONE_CHUNK: tl.constexpr, HAS_NTOK: tl.constexpr, HAS_NVIS: tl.constexpr,
                      PDL: tl.constexpr):
    """One program per (token, head) row: TOPK picks in (score desc, column asc) order."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    tok = row // Hi
    n_read = n_cols
    if HAS_NTOK:
        n_read = tl.where(tok < tl.load(ntok_ptr + ntok_idx), n_read, 0)  # padding: all -1
    if HAS_NVIS:
        # padding tokens' counts are never written: min(0, garbage) <= 0 still reads nothing
        n_read = tl.minimum(n_read, tl.load(nvis_ptr + tok))
    base = score_ptr + row * n_cols
    cols = tl.arange(0, CHUNK)
    slots = tl.arange(0, TOPK_P)
    res = tl.full([TOPK_P], -1, tl.int32)
    if ONE_CHUNK:  # the row fits registers: load once, knock out each pick
        x = tl.load(base + cols, mask=cols < n_read, other=-float("inf"))
        for i in tl.static_range(TOPK):
            m, idx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            res = tl.where(slots == i, tl.where(m == -float("inf"), -1, idx), res)
            x = tl.where(cols == idx, -float("inf"), x)
    else:  # pick i = the largest (score, -column) strictly below pick i-1, chunk by chunk
        pv = float("inf")
        pid = -1
        for i in range(TOPK):
            bv = -float("inf")
            bid = -1
            for c0 in range(0, n_read, CHUNK):
                c = c0 + cols
                x = tl.load(base + c, mask=c < n_read, other=-float("inf"))
                x = tl.where((x < pv) | ((x == pv) & (c > pid)), x, -float("inf"))
                m, idx = tl.max(x, axis=0, return_indices=True,
                                return_indices_tie_break_left=True)
                better = m > bv                       # earlier chunks win ties: lower column
                bid = tl.where(better, c0 + idx, bid)
                bv = tl.where(better, m, bv)
            res = tl.where(slots == i, tl.where(bv == -float("inf"), -1, bid), res)
            pv = bv
            pid = bid
    tl.store(out_ptr + row * TOPK + slots, res, mask=slots < TOPK)


def _check_inputs(iq, index_cache, block_size, max_seq_len):
    T, Hi, Di = iq.shape
    if index_cache.dim() != 3 or index_cache.shape[1:] != (block_size, Di):
        raise ValueError(f"index_cache shape {tuple(index_cache.shape)} != "
                         f"[blocks, {block_size}, {Di}]")
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len = {max_seq_len} must be >= 1")
    if not index_cache.is_contiguous():
        raise ValueError("index_cache must be contiguous")
    fp8 = index_cache.dtype == torch.float8_e4m3fn
    if not fp8 and iq.dtype != index_cache.dtype:
        raise ValueError(f"iq dtype {iq.dtype} != index_cache dtype {index_cache.dtype}")
    return T, Hi, Di, -(-max_seq_len // block_size)


def _launch_scores(iq, index_cache, query_start_loc, seq_lens, block_tables, scores, nvis, *,
                   block_size, local_blocks, init_blocks, max_query_len):
    """Stage-1 launch into scores [T, Hi, max_blocks] fp32 and nvis [T] int32 (host ints only)."""
    T, Hi, Di = iq.shape
    R = seq_lens.shape[0]
    max_blocks = scores.shape[2]
    if iq.stride(-1) != 1:
        iq = iq.contiguous()
    HP = triton.next_power_of_2(Hi)
    if max_query_len is not None:
        small = max_query_len * HP <= 16
    else:
        small = T == R  # a guess at a decode batch: tile size only, the mapping stays exact
    BLOCK_M = max(16, HP) if small else max(64, HP)
    TPT = BLOCK_M // HP
    n_packed = T // TPT + R  # bound on sum over requests of ceil(q_len / TPT)
    TPR = -(-max_query_len // TPT) if max_query_len is not None else 0
    direct = max_query_len is not None and R * TPR <= n_packed
    n_tiles = R * TPR if direct else n_packed
    parts = max(1, min(max_blocks, -(-TARGET_PROGRAMS // n_tiles)))
    interp = interpreting()
    q_fp8 = index_cache.dtype == torch.float8_e4m3fn and iq.dtype != torch.float8_e4m3fn
    pdl = pdl_enabled(iq)
    _index_score_kernel[(n_tiles, parts)](
        iq, index_cache, block_tables, query_start_loc, seq_lens, scores, nvis,
        R, max(TPR, 1), Hi, iq.stride(0), iq.stride(1), block_tables.stride(0), scores.stride(0),
        scores.stride(1), max_blocks, local_blocks, init_blocks,
        BS=block_size, DI=Di, HP=HP, BLOCK_M=BLOCK_M, TPT=TPT,
        # one request-count bucket up to 256 (more only past that): a batch that grows while
        # serving compiles nothing new (a compile stalls every request for ~0.5 s)
        R_P=1 if direct else max(256, triton.next_power_of_2(R)), DIRECT=direct, Q_FP8=q_fp8,
        DOT_FP32=interp or iq.dtype == torch.float32,
        IEEE=(not interp) and iq.dtype == torch.float32, EMULATE=interp, PDL=pdl,
        num_warps=4, num_stages=3, **launch_options(pdl))


def index_block_scores(iq, index_cache, query_start_loc, seq_lens, block_tables, *, block_size,
                       local_blocks, init_blocks=0, max_seq_len, max_query_len=None):
    """Stage 1 alone: fp32 [T, Hi, ceil(max_seq_len / block_size)] block scores (+inf forced,
    -inf for blocks a token cannot see and for batch-padding tokens). Arguments as in
    `index_topk`. Graph-safe (host-int shapes, no sync); fills the whole buffer first, which
    `index_topk` skips."""
    T, Hi, Di, max_blocks = _check_inputs(iq, index_cache, block_size, max_seq_len)
    scores = torch.full((T, Hi, max_blocks), -float("inf"), dtype=torch.float32,
                        device=iq.device)                                # [T, Hi, max_blocks]
    if T == 0 or seq_lens.shape[0] == 0:
        return scores
    nvis = torch.empty((T,), dtype=torch.int32, device=iq.device)      # [T]
    _launch_scores(iq, index_cache, query_start_loc, seq_lens, block_tables, scores, nvis,
                   block_size=block_size, local_blocks=local_blocks, init_blocks=init_blocks,
                   max_query_len=max_query_len)
    return scores


def index_topk(iq, index_cache, query_start_loc, seq_lens, block_tables, *, block_size, topk,
               local_blocks, init_blocks=0, max_seq_len, max_query_len=None, out=None):
    """MSA block selection for a flattened batch.

    iq: [T, Hi, Di] index queries (normed + rotated, activation dtype); index_cache:
    [num_blocks, block_size, Di] (bf16/fp16/fp32, or float8_e4m3fn: then iq is cast to e4m3
    in the kernel, no scales); query_start_loc: [R + 1] int32 (request r owns tokens
    qsl[r]:qsl[r+1], the last tokens of its context; tokens >= qsl[R] are batch padding and get
    all -1); seq_lens: [R] int32; block_tables: [R, >= max_seq_len / block_size] int32 (logical
    block -> page). Host ints: max_seq_len >= every seq_len (sizes the fp32 scratch
    [T, Hi, ceil(max_seq_len / block_size)]; under a CUDA graph, the capture-time bound);
    max_query_len (optional) >= every q_len: with it a decode batch (max_query_len 1) maps tiles
    to requests directly; without it the mapping is an in-kernel prefix sum (also exact).

    Returns [T, Hi, topk] int32 LOGICAL block ids (into `out` when given): forced blocks (own
    block and the local_blocks - 1 before it, blocks < init_blocks) first, then by descending
    block max of the fp32 scores, ties to the lower block id; each block at most once; -1
    padded past the valid blocks.

    CUDA-graph safe: no host sync, every buffer sized from T, Hi, topk and max_seq_len; three
    allocations (scratch, visible counts, output) and two kernel launches, no other torch op.
    Scoring work and top-k reads follow each request's real seq_len, not max_seq_len (the
    scratch is never filled: top-k reads only the columns stage 1 wrote).
    """
    T, Hi, Di, max_blocks = _check_inputs(iq, index_cache, block_size, max_seq_len)
    if out is None:
        out = torch.empty((T, Hi, topk), dtype=torch.int32, device=iq.device)  # [T, Hi, topk]
    _check_out(out, T, Hi, topk)
    if T == 0:
        return out
    if seq_lens.shape[0] == 0:
        return out.fill_(-1)
    scores = torch.empty((T, Hi, max_blocks), dtype=torch.float32, device=iq.device)
    nvis = torch.empty((T,), dtype=torch.int32, device=iq.device)      # [T] visible blocks
    _launch_scores(iq, index_cache, query_start_loc, seq_lens, block_tables, scores, nvis,
                   block_size=block_size, local_blocks=local_blocks, init_blocks=init_blocks,
                   max_query_len=max_query_len)
    return _launch_topk(scores, topk, out, (query_start_loc, seq_lens.shape[0]), nvis)


def _check_out(out, T, Hi, topk):
    if out.shape != (T, Hi, topk) or out.dtype != torch.int32:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} != [{T}, {Hi}, {topk}] int32")


def _launch_topk(scores, topk, out, num_tokens, nvis):
    """num_tokens: None or (int tensor, index of the real token count in it)."""
    T, Hi, n_cols = scores.shape
    if topk < 1:
        raise ValueError(f"topk = {topk} must be >= 1")
    if not scores.is_contiguous():
        scores = scores.contiguous()
    dst = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype,
                                                      device=out.device)
    # column buckets from 128 up (one variant for contexts up to 16K tokens), not one per pow2
    width = max(TOPK_MIN_COLUMNS, triton.next_power_of_2(max(n_cols, 1)))
    chunk = min(width, TOPK_CHUNK)
    pdl = pdl_enabled(scores)
    _topk_rows_kernel[(T * Hi,)](
        scores, dst, *(num_tokens if num_tokens is not None else (dst, 0)),
        nvis if nvis is not None else dst, Hi, n_cols, TOPK=topk,
        TOPK_P=triton.next_power_of_2(topk), CHUNK=chunk, ONE_CHUNK=width <= chunk,
        HAS_NTOK=num_tokens is not None, HAS_NVIS=nvis is not None, PDL=pdl,
        num_warps=_topk_warps(chunk), **launch_options(pdl))
    if dst is not out:
        out.copy_(dst)
    return out


def select_topk(scores: torch.Tensor, topk: int, out: torch.Tensor | None = None, *,
                num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 2: scores [T, Hi, n] fp32 -> [T, Hi, topk] int32 column ids in descending score
    order (equal scores: lower id first), -1 for -inf picks and past n. num_tokens: optional
    [1] int device tensor; rows of tokens >= it (batch padding) come out all -1.
    CUDA-graph safe: one launch (plus copies only for non-contiguous scores / out), no sync."""
    T, Hi, _ = scores.shape
    if out is None:
        out = torch.empty((T, Hi, topk), dtype=torch.int32, device=scores.device)
    _check_out(out, T, Hi, topk)
    if T == 0:
        return out
    return _launch_topk(scores, topk, out, None if num_tokens is None else (num_tokens, 0), None)
