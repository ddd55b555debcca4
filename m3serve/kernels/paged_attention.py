"""Triton paged attention for MiniMax-M3: causal attention of a flattened ragged batch over the
paged K/V cache, dense or MSA block-sparse (per-token selected logical blocks), bf16 or FP8 cache.
Decode runs one (token, KV group) per program, split-K with an LSE merge; multi-token batches
run flash-attention query tiles of (tokens x group heads) rows (sparse: over the union of the
tile's selected blocks, masked per row).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from m3serve import envs
from m3serve.kernels.pdl import enabled as pdl_enabled
from m3serve.kernels.pdl import launch_options, pdl_start
from m3serve.kernels.tma import tma_ready

_LOG2E = 1.4426950408889634

# Launch knobs (H200 starting points; the bench script in m3serve/bench/kernels times them).
_DECODE_BLOCK_N = 64          # keys per K/V tile in the per-token kernel
_DECODE_WARPS = 4
_DECODE_STAGES = 3
# Prefill tiles by (sparse, K/V through tensor descriptors): (query rows = tokens x heads of
# one group, keys per tile, warps, stages). Measured on an H200 over one 8K prompt
# (scripts/decode_kernels_bench.py prefill_attn): dense 2129 µs with TMA and 128 rows against
# 3044 by per-thread loads (64 rows: 2618); sparse 2544 against 2993.
_PREFILL_TILES = {(False, False): (64, 64, 4, 2), (True, False): (64, 64, 4, 3),
                  (False, True): (128, 64, 4, 3), (True, True): (64, 64, 4, 2)}
# Sparse multi-token batches: query tiles over the union of their blocks (False = per-token).
_SPARSE_PREFILL_TILED = True
# Prefill K/V tiles through tensor descriptors on Hopper and newer (bf16/fp16 caches).
_PREFILL_TMA = True
# Steps whose queries are at most this many tokens per request (decode; the verify step of
# speculative decoding, k + 1 tokens) run one program per token with split-K over the context,
# so long contexts stay parallel; longer queries take the tiled prefill kernel.
TOKEN_KERNEL_MAX_QUERY = 8
_PROGRAMS_PER_SM = 2          # split-K aims for this many programs per SM
_MIN_KEYS_PER_SPLIT = 256     # below this the partial-output traffic outweighs the parallelism
# Sparse layers: at most top-k blocks per query, so the split count is known to be useful
# (measured on an H200 at 1 token: 6.3 vs 9.0 µs with 64 rather than 256 keys per split).
_MIN_KEYS_PER_SPLIT_SPARSE = 64
_MAX_SPLITS = 64
_DEFAULT_SMS = 132            # H200; used when no CUDA device is visible (interpreter runs)


@triton.jit
def _request_of_token(query_start_loc, t, num_reqs):
    """Largest r in [0, num_reqs) with query_start_loc[r] <= t (skips empty requests)."""
    lo = t * 0
    hi = lo + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(query_start_loc + mid) <= t
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _request_of_tile(query_start_loc, pid, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest r with query_start_loc[r] // BLOCK_Q + r <= pid: request r's query tiles are the
    program ids starting there (that start index is monotone in r and leaves room for a partial
    tile per request)."""
    lo = pid * 0
    hi = lo + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(query_start_loc + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _softmax_step(q, k, v, visible, qk_scale, m_i, l_i, acc, MASKED: tl.constexpr):
    """One online-softmax step of q [M, D] over keys k [D, N] and values v [N, D]; visible
    [M, N] masks the scores (base-2 domain) when MASKED."""
    qk = tl.dot(q, k) * qk_scale                                               # [M, N] fp32
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attend_tile_tma(q, k_desc, v_desc, row0, col0, visible, qk_scale, m_i, l_i, acc,
                     MASKED: tl.constexpr):
    """`_softmax_step` over the K/V tile at cache row row0, column col0 (the group's first
    dimension), loaded through tensor descriptors."""
    return _softmax_step(q, k_desc.load([row0, col0]).T, v_desc.load([row0, col0]), visible,
                         qk_scale, m_i, l_i, acc, MASKED)


@triton.jit
def _attend_tile(q, k_base, v_base, rows, load_ok, visible, qk_scale, m_i, l_i, acc,
                 D: tl.constexpr):
    """One online-softmax step of q [M, D] over the K/V rows at `rows` [N] (offsets from the
    group's base); load_ok [N] masks the loads, visible [M, N] the scores (base-2 domain)."""
    dims = tl.arange(0, D)
    k = tl.load(k_base + rows[None, :] + dims[:, None], mask=load_ok[None, :], other=0.0)  # [D, N]
    v = tl.load(v_base + rows[:, None] + dims[None, :], mask=load_ok[:, None], other=0.0)  # [N, D]
    return _softmax_step(q, k.to(q.dtype), v.to(q.dtype), visible, qk_scale, m_i, l_i, acc, True)


# sizes that change from step to step are not specialised on (no recompiles mid-serving), nor
# the index operands' addresses: a step's requests may start at any row of the staged buffers,
# so their 16-byte alignment changes from step to step (one scalar load per program each)
@triton.jit(do_not_specialize=["num_reqs", "stride_bt", "topk", "stride_it", "stride_ig",
                               "query_start_loc", "seq_lens", "block_tables", "block_ids_ptr",
                               "key_lo_ptr"])
def _token_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
    query_start_loc, seq_lens, block_tables, block_ids_ptr, k_scale_ptr, v_scale_ptr, key_lo_ptr,
    qk_scale, num_reqs, topk,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_ot, stride_oh, stride_bt,
    stride_it, stride_ig, stride_ik,
    HPG: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SPARSE: tl.constexpr, FP8: tl.constexpr,
    HAS_LO: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr,
):
    """One program = (token t, KV group g, split s): the group's HPG heads are the M rows.
    With splits and MERGE, the program of (t, g) that finishes last (a counter per (t, g), reset
    by it) merges the group's splits into out: no merge kernel."""
    pdl_start(PDL)
    t = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    TILES_PER_BLOCK: tl.constexpr = BLOCK_SIZE // BLOCK_N
    r = _request_of_token(query_start_loc, t, num_reqs)
    pos = tl.load(seq_lens + r) - tl.load(query_start_loc + r + 1) + t  # this token's position

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    head_ok = heads < HPG
    q = tl.load(q_ptr + t * stride_qt + (g * HPG + heads)[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None], other=0.0)                              # [BLOCK_H, D]
    if FP8:  # k_scale folds into the logit scale, v_scale into the output
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    if SPARSE:
        num_tiles = topk * TILES_PER_BLOCK
    else:
        num_tiles = tl.cdiv(pos + 1, BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = s * per_split
    hi = tl.minimum(lo + per_split, num_tiles)

    # A finite start keeps exp2(m_old - m_new) defined while every key so far was masked.
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    k_base = k_ptr + g * stride_kh
    v_base = v_ptr + g * stride_kh
    for i in range(lo, hi):
        if SPARSE:
            blk = tl.load(block_ids_ptr + t * stride_it + g * stride_ig
                          + (i // TILES_PER_BLOCK) * stride_ik).to(tl.int32)
            start = blk * BLOCK_SIZE + (i % TILES_PER_BLOCK) * BLOCK_N
            # -1 padding and blocks past the token (beyond its block-table row) read nothing.
            blk_ok = (blk >= 0) & (blk * BLOCK_SIZE <= pos)
            page = tl.load(block_tables + r * stride_bt + blk, mask=blk_ok, other=0).to(tl.int64)
            # (vector-only mask: the interpreter mistypes scalar & vector int1)
            key_ok = (start + offs_n >= 0) & (start + offs_n <= pos)
        else:
            start = i * BLOCK_N
            page = tl.load(block_tables + r * stride_bt + start // BLOCK_SIZE).to(tl.int64)
            key_ok = start + offs_n <= pos
        if HAS_LO:  # a left edge per token (a sliding window)
            key_ok = key_ok & (start + offs_n >= tl.load(key_lo_ptr + t))
        rows = page * stride_kp + ((start % BLOCK_SIZE) + offs_n) * stride_kt   # [BLOCK_N]
        m_i, l_i, acc = _attend_tile(q, k_base, v_base, rows, key_ok, key_ok[None, :], qk_scale,
                                     m_i, l_i, acc, D)

    if FP8:
        acc = acc * tl.load(v_scale_ptr)
    has_keys = l_i > 0.0  # a token that sees no key gets 0, not NaN
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    head_idx = g * HPG + heads
    if NUM_SPLITS == 1:
        tl.store(out_ptr + t * stride_ot + head_idx[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        row = (t * (tl.num_programs(1) * HPG) + head_idx) * NUM_SPLITS + s  # [T, H, S] index
        tl.store(part_lse_ptr + row, lse, mask=head_ok)
        tl.store(part_o_ptr + row[:, None] * D + dims[None, :], o, mask=head_ok[:, None])
        if MERGE:
            tl.debug_barrier()    # every thread's partials are written before the release below
            count = counter_ptr + t * tl.num_programs(1) + g
            if tl.atomic_add(count, 1, sem="acq_rel") == NUM_SPLITS - 1:
                tl.debug_barrier()
                _merge_group(part_o_ptr, part_lse_ptr, out_ptr + t * stride_ot,
                             (t * (tl.num_programs(1) * HPG) + head_idx) * NUM_SPLITS, head_idx, head_ok,
                             stride_oh, D, NUM_SPLITS)
                tl.atomic_xchg(count, 0, sem="relaxed")


@triton.jit
def _merge_group(part_o_ptr, part_lse_ptr, out_ptr, first_row, head_idx, head_ok, stride_oh,
                 D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """out[h] = LSE-weighted sum of head h's split partials (rows first_row[h] + s, base-2
    log-sum-exp), for the heads [BLOCK_H] of one token, the partials of the other programs read
    from L2; the splits summed in order (`_merge_splits_kernel` sums them as a tree: fp32 values
    nearly equal)."""
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, D)
    rows = first_row[:, None] + splits[None, :]                                 # [BLOCK_H, S]
    lse = tl.load(part_lse_ptr + rows, mask=head_ok[:, None], other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[:, None])                                               # [BLOCK_H, S]
    den = tl.sum(w, 1)
    acc = tl.zeros((first_row.shape[0], D), dtype=tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        at = (first_row + sp)[:, None] * D + dims[None, :]
        o = tl.load(part_o_ptr + at, mask=head_ok[:, None], other=0.0, cache_modifier=".cg")
        acc += tl.sum(tl.where(splits[None, :] == sp, w, 0.0), 1)[:, None] * o
    res = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(out_ptr + head_idx[:, None] * stride_oh + dims[None, :], res.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None])


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_heads,
                         D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         PDL: tl.constexpr):
    """out[t, h] = LSE-weighted sum of the split partials (base-2 log-sum-exp)."""
    pdl_start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, D)
    row = (t * num_heads + h) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + row)                                          # [S]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(part_o_ptr + row[:, None] * D + dims[None, :])                 # [S, D]
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, res.to(out_ptr.dtype.element_ty))


# sizes that change from step to step are not specialised on (no recompiles mid-serving)
@triton.jit(do_not_specialize=["num_reqs", "stride_bt", "union_width", "num_kv_rows"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_loc, seq_lens, block_tables, block_ids_ptr,
    union_ptr, union_count_ptr, union_width, k_scale_ptr, v_scale_ptr, qk_scale, num_reqs, topk,
    num_kv_rows, stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_ot, stride_oh,
    stride_bt, stride_it, stride_ig, stride_ik,
    HPG: tl.constexpr, HPG_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TOPK_PAD: tl.constexpr, SPARSE: tl.constexpr,
    FP8: tl.constexpr, TMA: tl.constexpr, G: tl.constexpr,
):
    """One program = (query tile of BLOCK_Q tokens of one request, KV group g); its M rows are
    token-major (token, head-of-group) pairs so every K/V tile serves all heads of the group.
    Sparse: the tile visits the union of its tokens' selected blocks once each (listed per
    (tile, group) by `_tile_block_union`), every row masked to its own token's selection.
    Dense: the key tiles wholly before the tile's first token run without masks, the rest
    (the diagonal) masked. TMA: K/V tiles come through tensor descriptors of the cache planes
    viewed as [num_kv_rows = pages x BLOCK_SIZE, G x D] (loads are not masked: slots past a
    sequence hold finite stale or zero values, and their scores are masked)."""
    BLOCK_M: tl.constexpr = BLOCK_Q * HPG_PAD
    pid = tl.program_id(0)
    g = tl.program_id(1)
    r = _request_of_tile(query_start_loc, pid, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + r)
    q_len = tl.load(query_start_loc + r + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + r)
    if tile * BLOCK_Q >= q_len:
        return
    ctx_start = tl.load(seq_lens + r) - q_len  # position of the request's first query token

    offs_m = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + offs_m // HPG_PAD                                   # query index in r
    head = g * HPG + offs_m % HPG_PAD
    row_ok = (tok < q_len) & (offs_m % HPG_PAD < HPG)
    q_pos = ctx_start + tok
    dims = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + dims[None, :], mask=row_ok[:, None], other=0.0)              # [BLOCK_M, D]
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    last_pos = ctx_start + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_base = k_ptr + g * stride_kh
    v_base = v_ptr + g * stride_kh
    if TMA:
        k_desc = tl.make_tensor_descriptor(k_ptr, shape=[num_kv_rows, G * D], strides=[stride_kt, 1],
                                           block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[num_kv_rows, G * D], strides=[stride_kt, 1],
                                           block_shape=[BLOCK_N, D])
    if SPARSE:
        TILES_PER_BLOCK: tl.constexpr = BLOCK_SIZE // BLOCK_N
        kk = tl.arange(0, TOPK_PAD)
        tok_ok = tok < q_len
        ids = tl.load(block_ids_ptr + (q_start + tok)[:, None] * stride_it + g * stride_ig
                      + kk[None, :] * stride_ik, mask=tok_ok[:, None] & (kk < topk)[None, :],
                      other=-1).to(tl.int32)                                   # [BLOCK_M, TOPK_PAD]
        union = union_ptr + (pid * tl.num_programs(1) + g).to(tl.int64) * union_width
        num_union = tl.load(union_count_ptr + pid * tl.num_programs(1) + g)
        # One flat loop over (union block, sub-tile) with no branch in it, so the K/V loads
        # software-pipeline; keys past the tile's last token are masked (a block past it in a
        # malformed selection reads page 0, never a page beyond the table row).
        for j in range(0, num_union * TILES_PER_BLOCK):
            blk = tl.load(union + j // TILES_PER_BLOCK)
            sub = j % TILES_PER_BLOCK
            row_sel = tl.max(tl.where(ids == blk, 1, 0), 1) > 0                   # [BLOCK_M]
            start = blk * BLOCK_SIZE + sub * BLOCK_N
            page = tl.load(block_tables + r * stride_bt + blk, mask=start <= last_pos,
                           other=0).to(tl.int64)
            key_pos = start + offs_n
            visible = row_sel[:, None] & (key_pos[None, :] <= q_pos[:, None])
            if TMA:
                row0 = (page * BLOCK_SIZE + sub * BLOCK_N).to(tl.int32)
                m_i, l_i, acc = _attend_tile_tma(q, k_desc, v_desc, row0, g * D, visible,
                                                 qk_scale, m_i, l_i, acc, True)
            else:
                rows = page * stride_kp + (sub * BLOCK_N + offs_n) * stride_kt
                m_i, l_i, acc = _attend_tile(q, k_base, v_base, rows, key_pos <= last_pos,
                                             visible, qk_scale, m_i, l_i, acc, D)
    else:
        num_full = 0
        if TMA:   # the key tiles every row sees whole: before the tile's first token
            num_full = (ctx_start + tile * BLOCK_Q + 1) // BLOCK_N
            for i in range(0, num_full):
                start = i * BLOCK_N
                page = tl.load(block_tables + r * stride_bt + start // BLOCK_SIZE)
                m_i, l_i, acc = _attend_tile_tma(q, k_desc, v_desc,
                                                 page * BLOCK_SIZE + start % BLOCK_SIZE, g * D,
                                                 q_pos, qk_scale, m_i, l_i, acc, False)
        for i in range(num_full, tl.cdiv(last_pos + 1, BLOCK_N)):
            start = i * BLOCK_N
            page = tl.load(block_tables + r * stride_bt + start // BLOCK_SIZE)
            key_pos = start + offs_n
            visible = key_pos[None, :] <= q_pos[:, None]
            if TMA:
                m_i, l_i, acc = _attend_tile_tma(q, k_desc, v_desc,
                                                 page * BLOCK_SIZE + start % BLOCK_SIZE, g * D,
                                                 visible, qk_scale, m_i, l_i, acc, True)
            else:
                rows = page.to(tl.int64) * stride_kp + ((start % BLOCK_SIZE) + offs_n) * stride_kt
                m_i, l_i, acc = _attend_tile(q, k_base, v_base, rows, key_pos <= last_pos,
                                             visible, qk_scale, m_i, l_i, acc, D)

    if FP8:
        acc = acc * tl.load(v_scale_ptr)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _tile_block_union(block_ids: torch.Tensor, query_start_loc: torch.Tensor, num_reqs: int,
                      block_q: int, num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct selected blocks of each prefill tile's tokens, per KV group.

    block_ids: [T, G, topk] (-1 padded); tiles as `_request_of_tile` numbers them (request r's
    tokens in runs of block_q from program q_start[r] // block_q + r). Returns union
    [num_tiles, G, block_q * topk] int32 (distinct ids first, then -1) and counts
    [num_tiles, G] int32. Device work only (sorts), no host sync."""
    T, G, topk = block_ids.shape
    dev = block_ids.device
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]                                                  # [R]
    req = torch.repeat_interleave(torch.arange(num_reqs, device=dev), q_lens, output_size=T)
    local = torch.arange(T, device=dev) - qsl[:-1][req]                          # [T]
    tile = qsl[:-1][req] // block_q + req + local // block_q                     # [T]
    slot = (local % block_q)[:, None] * topk + torch.arange(topk, device=dev)   # [T, topk]
    width = block_q * topk
    flat = (tile[:, None, None] * G + torch.arange(G, device=dev)[None, :, None]) * width + slot[:, None, :]
    entries = torch.full((num_tiles * G * width,), -1, dtype=torch.int32, device=dev)
    entries[flat.reshape(-1)] = block_ids.reshape(-1).to(torch.int32)
    entries = entries.view(num_tiles, G, width).sort(dim=-1).values
    repeat = torch.zeros_like(entries, dtype=torch.bool)
    repeat[..., 1:] = entries[..., 1:] == entries[..., :-1]
    union = entries.masked_fill(repeat, -1).sort(dim=-1, descending=True).values
    return union.contiguous(), (union >= 0).sum(-1, dtype=torch.int32)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_COUNTER_SLOTS = 1 << 18      # (token, KV group) pairs one launch may merge in its kernel


def _merge_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The per-(token, group) arrival counters of the in-kernel split merge (zeros; each merge
    resets its own), made once per device outside any CUDA-graph capture; None (the separate
    merge kernel) for more than _COUNTER_SLOTS pairs or while a capture is under way before they
    exist. Launches on one device must not overlap (they share the counters)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
    return counters if n <= _COUNTER_SLOTS else None


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _num_splits(num_programs: int, max_tiles: int, block_n: int, device: torch.device,
                min_keys: int) -> int:
    """Splits per (token, group): enough programs to fill the SMs, but each split keeps at least
    min_keys keys. A power of two (the merge kernel's tile width)."""
    want = _num_sms(device) * _PROGRAMS_PER_SM // max(1, num_programs)
    cap = max_tiles // max(1, min_keys // block_n)
    return _pow2_floor(min(want, cap, _MAX_SPLITS))


def _check_inputs(q, kv_cache, query_start_loc, seq_lens, block_tables, block_ids, k_scale, v_scale,
                  out, max_query_len, max_seq_len) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, G, D], got {tuple(kv_cache.shape)}")
    T, H, D = q.shape
    _, _, bs, G, Dk = kv_cache.shape
    if Dk != D:
        raise ValueError(f"kv_cache head_dim {Dk} != q head_dim {D}")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {D}")
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {bs}")
    if G == 0 or H % G:
        raise ValueError(f"num_heads {H} is not a multiple of num_kv_heads {G}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's head_dim must be contiguous (stride 1)")
    if kv_cache.dtype == torch.float8_e4m3fn:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None or sc.numel() != 1 or sc.dtype != torch.float32:
                raise ValueError(f"fp8 kv_cache needs {name} as a 1-element fp32 tensor, got {sc!r}")
    elif kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must match q dtype {q.dtype} or be float8_e4m3fn")
    R = seq_lens.shape[0]
    if query_start_loc.shape != (R + 1,):
        raise ValueError(f"query_start_loc must be [{R + 1}], got {tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != R:
        raise ValueError(f"block_tables must be [{R}, max_blocks], got {tuple(block_tables.shape)}")
    if block_ids is not None and (block_ids.dim() != 3 or block_ids.shape[:2] != (T, G)):
        raise ValueError(f"block_ids must be [{T}, {G}, topk], got {tuple(block_ids.shape)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with contiguous head_dim, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if max_query_len < 0 or max_seq_len < 0:
        raise ValueError(f"max_query_len/max_seq_len must be >= 0, got {max_query_len}/{max_seq_len}")


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                    block_ids: torch.Tensor | None = None, max_query_len: int, max_seq_len: int,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, key_lo: torch.Tensor | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """Causal attention of every query token over its request's paged context.

    q: [T, H, D] (bf16 on GPU); kv_cache: [2, num_blocks, block_size, G, D] (plane 0 = K, 1 = V),
    q's dtype or float8_e4m3fn with 1-element fp32 k_scale / v_scale (value = stored * scale).
    query_start_loc: [R+1] int32; seq_lens: [R] int32; block_tables: [R, max_blocks] int32 logical
    block -> page. Request r's queries are tokens query_start_loc[r]:query_start_loc[r+1], the last
    q_len positions of its seq_lens[r]-token context.
    block_ids: None (dense) or [T, G, topk] int32/int64 logical blocks (-1 padded, deduplicated,
    any order): token t / group g then sees key j iff j//block_size is selected and j <= its
    position. A token that sees no key gets 0.
    max_query_len / max_seq_len: host-side bounds that pick the kernel and the split count only.
    query_start_loc[R] must equal T (the tiled sparse path numbers its tiles on the device from
    it). Cache slots past a sequence's length inside its blocks must hold finite values: the
    prefill path may read blocks whole and mask the scores, and a zero weight times a NaN value
    is NaN. The engine zero-fills the cache; a non-finite K/V that a request wrote would reach a
    later request whose last, partly filled block reuses that page.
    key_lo: None or [T] int32/int64, token t's first visible key position (a sliding window);
    only with max_query_len <= TOKEN_KERNEL_MAX_QUERY (the token kernel).
    num_splits: the token kernel's split count, forced (the start-up warm-up compiles each).
    Returns out ([T, H, D], q's dtype); softmax in fp32.
    """
    _check_inputs(q, kv_cache, query_start_loc, seq_lens, block_tables, block_ids, k_scale, v_scale,
                  out, max_query_len, max_seq_len)
    T, H, D = q.shape
    bs, G = kv_cache.shape[2], kv_cache.shape[3]
    R = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or R == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    k_sc = k_scale if fp8 else seq_lens  # placeholder pointers, never read without FP8
    v_sc = v_scale if fp8 else seq_lens
    k, v = kv_cache[0], kv_cache[1]
    hpg = H // G
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
              out.stride(0), out.stride(1), block_tables.stride(0))
    sparse = block_ids is not None
    if key_lo is not None and max_query_len > TOKEN_KERNEL_MAX_QUERY:
        raise ValueError(f"key_lo (a per-token left edge) needs max_query_len <= {TOKEN_KERNEL_MAX_QUERY}, "
                         f"got {max_query_len}")
    if max_query_len <= TOKEN_KERNEL_MAX_QUERY or (sparse and not _SPARSE_PREFILL_TILED):
        block_n = min(bs, _DECODE_BLOCK_N)
        if sparse:
            topk = block_ids.shape[2]
            max_tiles = topk * (bs // block_n)
            ids, id_strides = block_ids, block_ids.stride()
        else:
            topk = 0
            max_tiles = triton.cdiv(max_seq_len, block_n)
            ids, id_strides = seq_lens, (0, 0, 0)
        splits = num_splits or _num_splits(T * G, max_tiles, block_n, q.device,
                                           _MIN_KEYS_PER_SPLIT_SPARSE if sparse else _MIN_KEYS_PER_SPLIT)
        part_o = part_lse = out  # placeholders when there is a single split
        if splits > 1:
            part_o = torch.empty((T, H, splits, D), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
        counter = _merge_counters(q.device, T * G) if splits > 1 and envs.SPLIT_MERGE_IN_KERNEL else None
        block_h = max(16, triton.next_power_of_2(hpg))
        pdl = pdl_enabled(q)
        _token_attn_kernel[(T, G, splits)](
            q, k, v, out, part_o, part_lse, seq_lens if counter is None else counter, query_start_loc,
            seq_lens, block_tables, ids, k_sc, v_sc,
            seq_lens if key_lo is None else key_lo, scale * _LOG2E, R, topk, *common, *id_strides,
            HPG=hpg, BLOCK_H=block_h, D=D, BLOCK_SIZE=bs,
            BLOCK_N=block_n, NUM_SPLITS=splits, SPARSE=sparse, FP8=fp8, HAS_LO=key_lo is not None,
            MERGE=counter is not None, PDL=pdl, num_warps=_DECODE_WARPS, num_stages=_DECODE_STAGES,
            **launch_options(pdl))
        if splits > 1 and counter is None:
            _merge_splits_kernel[(T, H)](part_o, part_lse, out, out.stride(0), out.stride(1), H,
                                         D=D, NUM_SPLITS=splits, PDL=pdl, num_warps=4,
                                         **launch_options(pdl))
        return out
    hpg_pad = triton.next_power_of_2(hpg)
    num_kv_rows = kv_cache.shape[1] * bs
    # descriptors view each plane as [pages x block_size, G x D] rows (bf16/fp16 caches)
    tma = (_PREFILL_TMA and not fp8 and tma_ready(q.device) and k.stride(2) == D
           and k.stride(0) == bs * k.stride(1) and k.stride(1) == G * D and v.stride() == k.stride()
           and num_kv_rows < 2 ** 31)
    rows, keys, warps, stages = _PREFILL_TILES[sparse, tma]
    block_q = max(1, rows // hpg_pad)
    block_q = min(block_q, triton.next_power_of_2(max_query_len))
    block_q = max(block_q, triton.cdiv(16, hpg_pad))  # tl.dot needs M >= 16
    block_n = min(bs, keys)
    topk = block_ids.shape[2] if sparse else 0
    ids, id_strides = (block_ids, block_ids.stride()) if sparse else (seq_lens, (0, 0, 0))
    grid = (T // block_q + R, G)
    union, counts = (_tile_block_union(block_ids, query_start_loc, R, block_q, grid[0]) if sparse
                     else (seq_lens[:, None, None], seq_lens))       # placeholders when dense
    _prefill_kernel[grid](
        q, k, v, out, query_start_loc, seq_lens, block_tables, ids, union, counts,
        union.shape[-1], k_sc, v_sc, scale * _LOG2E, R, topk, num_kv_rows, *common, *id_strides,
        HPG=hpg, HPG_PAD=hpg_pad, BLOCK_Q=block_q, D=D, BLOCK_SIZE=bs, BLOCK_N=block_n,
        TOPK_PAD=max(1, triton.next_power_of_2(topk)), SPARSE=sparse, FP8=fp8, TMA=tma, G=G,
        num_warps=warps if block_q * hpg_pad >= rows else min(warps, 4), num_stages=stages)
    return out


def warm_up_token_kernel(num_heads: int, kv_cache: torch.Tensor, dtype: torch.dtype, *, sparse: bool,
                         key_lo: bool = False, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> None:
    """Compile every split count of the per-token kernel (and its merge) for one layer's
    configuration: the count follows the step's tokens and context lengths, so eager steps of
    new sizes (verify rows, draft steps) would otherwise compile while serving. One query on
    the null page 0, nothing written."""
    dev, G, D = kv_cache.device, kv_cache.shape[3], kv_cache.shape[4]
    q = torch.zeros(1, num_heads, D, dtype=dtype, device=dev)
    one = torch.ones(1, dtype=torch.int32, device=dev)
    args = dict(query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev), seq_lens=one,
                block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev), scale=1.0,
                block_ids=torch.zeros(1, G, 1, dtype=torch.int32, device=dev) if sparse else None,
                max_query_len=1, max_seq_len=1, k_scale=k_scale, v_scale=v_scale,
                key_lo=torch.zeros(1, dtype=torch.int64, device=dev) if key_lo else None)
    splits = 1
    while splits <= _MAX_SPLITS:
        paged_attention(q, kv_cache, num_splits=splits, **args)
        splits *= 2
