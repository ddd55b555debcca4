"""The CPU path of attention and of the MSA indexer: the reference ops' contracts
(`kernels/ref/paged_attention.py`, `kernels/ref/indexer.py`) without the work that cannot change
a result, so long prefills stay affordable on a few cores.

Each request's context is gathered from its pages once per call; queries go in tiles against the
keys they can see (causal), and sparse layers attend only to their chosen blocks. Query tokens
at positions below `exact_positions` (M3SERVE_CPU_EXACT_POSITIONS, default 4096) are computed in
fp64 from the reference's operands: bit-identical to the references. From that position on, in
fp32: flash attention over query tiles on a fixed grid and fp32 index scores, each query's numbers
still independent of the chunk or batch it comes in.
"""
from __future__ import annotations

import math

import torch

from m3serve import envs

_TILE_BYTES = 8 << 20   # bound on one fp64 tile's score tensor (stays in a core's L2 / the L3)
_FAST_TILE_BYTES = 64 << 20  # fp32 index scores: fewer, larger products
# fp32 attention: query tiles on this grid of absolute positions. Every tile is computed whole,
# so a decode token costs a whole tile against its context: 64 rows made a decode step at 18K
# tokens of context ~8x cheaper than 1024 rows, a 30K-token prefill ~20 % dearer (docs/performance.md)
_FLASH_TILE = 64
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def exact_positions() -> int:
    return envs.CPU_EXACT_POSITIONS


def _context(plane: torch.Tensor, block_table_row: torch.Tensor, length: int, dtype: torch.dtype,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """plane: [num_blocks, block_size, *rest] -> the first `length` positions of one request in
    `dtype` (times `scale`), [ceil(length / block_size) * block_size, *rest]; the positions past
    `length` in the last page are zero."""
    bs = plane.shape[1]
    pages = block_table_row[:-(-length // bs)].long()
    x = plane[pages].reshape(-1, *plane.shape[2:]).to(dtype)
    if scale is not None:
        x = x * scale.to(dtype)
    x[length:] = 0.0
    return x


def attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                  block_ids: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `paged_attention_ref` without `key_lo` (q: [T, H, D]; kv_cache:
    [2, num_blocks, block_size, G, D]; block_ids: None (dense) or [T, G, topk], -1 padded).
    Returns [T, H, D] in q's dtype."""
    T, H, D = q.shape
    bs, G = kv_cache.shape[2], kv_cache.shape[3]
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    ks, vs = (k_scale, v_scale) if fp8 else (None, None)
    exact = exact_positions()
    out = torch.empty_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, L in enumerate(lens):
        qs, qe = qsl[r], qsl[r + 1]
        first = L - (qe - qs)                                  # position of the request's first query
        split = qs + min(qe - qs, max(0, exact - first))       # queries [qs, split) are exact
        for a, b, acc in ((qs, split, torch.float64), (split, qe, torch.float32)):
            if a == b:
                continue
            n_keys = L - (qe - b)                                  # keys these queries see
            k = _context(kv_cache[0], block_tables[r], n_keys, acc, ks)   # [ceil(n_keys / bs) * bs, G, D]
            v = _context(kv_cache[1], block_tables[r], n_keys, acc, vs)
            qr = q[a:b].to(acc).view(b - a, G, H // G, D)                 # [t, G, hpg, D]
            p0 = first + a - qs
            if block_ids is not None:
                o = _sparse(qr, k, v, p0, scale, block_ids[a:b], bs)
            elif acc == torch.float64:
                o = _dense_exact(qr, k, v, p0, scale)
            else:
                o = _dense_flash(qr, k, v, p0, scale)
            out[a:b] = o.reshape(b - a, H, D).to(q.dtype)
    return out


def _dense_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float) -> torch.Tensor:
    """Causal attention of the queries at positions [first, first + Tq) in fp64: q [Tq, G, hpg,
    D], k/v [>= first + Tq, G, D] -> [Tq, G, hpg, D] fp64."""
    Tq, G, hpg, D = q.shape
    kg, vg = k.transpose(0, 1), v.transpose(0, 1)          # [G, keys, D]
    qg = q.permute(1, 0, 2, 3)                             # [G, Tq, hpg, D]
    out = torch.empty(G, Tq, hpg, D, dtype=q.dtype)
    tile = max(1, _TILE_BYTES // (G * hpg * (first + Tq) * q.element_size()))
    for t0 in range(0, Tq, tile):
        t1 = min(Tq, t0 + tile)
        p0, p1 = first + t0, first + t1                    # positions [p0, p1); keys [0, p1)
        rows = qg[:, t0:t1].reshape(G, (t1 - t0) * hpg, D)
        s = torch.bmm(rows, kg[:, :p1].transpose(1, 2)).mul_(scale)           # [G, t * hpg, p1]
        diag = s[:, :, p0:].view(G, t1 - t0, hpg, p1 - p0)
        q_pos = torch.arange(p0, p1)
        diag.masked_fill_((torch.arange(p0, p1)[None, :] > q_pos[:, None])[None, :, None, :], -math.inf)
        out[:, t0:t1] = torch.bmm(torch.softmax(s, -1), vg[:, :p1]).view(G, t1 - t0, hpg, D)
    return out.permute(1, 0, 2, 3)


def _dense_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float) -> torch.Tensor:
    """Causal attention of the queries at positions [first, first + Tq) in fp32 with torch's
    CPU flash attention: q [Tq, G, hpg, D], k/v [>= first + Tq, G, D] -> [Tq, G, hpg, D].

    Query tiles are the `_FLASH_TILE` positions [a, a + _FLASH_TILE) of a fixed grid, always
    whole (zero rows where the call has no query, their outputs dropped): a tile attends to the
    keys before a without a mask and to its own span causally, and the two parts are merged by
    their log-sum-exps. Every launch a query takes part in has the same shape whatever the
    chunking, so its result depends on its position only."""
    Tq, G, hpg, D = q.shape
    H, end, tile = G * hpg, first + Tq, _FLASH_TILE
    lo, hi = first - first % tile, -(-end // tile) * tile          # the tiles' span
    kv_pad = k.new_zeros(2, hi, G, D)
    kv_pad[0, :end], kv_pad[1, :end] = k[:end], v[:end]
    kh, vh = kv_pad.repeat_interleave(hpg, 2).permute(0, 2, 1, 3)[:, None]   # [1, H, hi, D] each
    q_pad = q.new_zeros(hi - lo, H, D)
    q_pad[first - lo:end - lo] = q.reshape(Tq, H, D)
    q_pad = q_pad.transpose(0, 1)                                     # [H, hi - lo, D]
    out = q.new_empty(H, hi - lo, D)
    for a in range(lo, hi, tile):
        qt = q_pad[None, :, a - lo:a - lo + tile].contiguous()         # [1, H, tile, D]
        o, lse = _flash(qt, kh[:, :, a:a + tile], vh[:, :, a:a + tile], 0.0, True, scale=scale)
        if a > 0:
            o_pre, lse_pre = _flash(qt, kh[:, :, :a], vh[:, :, :a], 0.0, False, scale=scale)
            both = torch.logaddexp(lse, lse_pre)
            o = o * (lse - both).exp()[..., None] + o_pre * (lse_pre - both).exp()[..., None]
        out[:, a - lo:a - lo + tile] = o[0]
    return out[:, first - lo:end - lo].transpose(0, 1).reshape(Tq, G, hpg, D)


def _sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float,
            block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Attention of the queries at positions [first, first + Tq) to their chosen blocks only, in
    q's dtype: q [Tq, G, hpg, D], k/v [n_blocks * bs, G, D], block_ids [Tq, G, topk] (-1 padded,
    ids outside k/v and repeats ignored) -> [Tq, G, hpg, D]."""
    Tq, G, hpg, D = q.shape
    bs, n_blocks = block_size, k.shape[0] // block_size
    spare = k.new_zeros(1, bs, G, D)                                         # the junk ids' block
    kb = torch.cat([k.view(n_blocks, bs, G, D), spare]).permute(2, 0, 1, 3)   # [G, nb + 1, bs, D]
    vb = torch.cat([v.view(n_blocks, bs, G, D), spare]).permute(2, 0, 1, 3)
    sel = block_ids.long()
    sel = torch.where((sel >= 0) & (sel < n_blocks), sel, n_blocks).sort(-1).values   # [Tq, G, topk]
    repeat = torch.zeros_like(sel, dtype=torch.bool)
    repeat[..., 1:] = sel[..., 1:] == sel[..., :-1]
    sel = sel.masked_fill(repeat, n_blocks)
    topk = sel.shape[-1]
    offsets = torch.arange(bs)
    group = torch.arange(G)[None, :, None]
    out = torch.empty(Tq, G, hpg, D, dtype=q.dtype)
    tile = max(1, _TILE_BYTES // (G * topk * bs * D * q.element_size()))
    for t0 in range(0, Tq, tile):
        t1 = min(Tq, t0 + tile)
        ids = sel[t0:t1]                                                        # [t, G, topk]
        keys = kb[group, ids].view(t1 - t0, G, topk * bs, D)                    # [t, G, topk * bs, D]
        vals = vb[group, ids].view(t1 - t0, G, topk * bs, D)
        key_pos = (ids[..., None] * bs + offsets).view(t1 - t0, G, 1, topk * bs)
        q_pos = torch.arange(first + t0, first + t1)[:, None, None, None]
        hidden = (key_pos > q_pos) | (ids == n_blocks).repeat_interleave(bs, -1)[:, :, None, :]
        s = torch.matmul(q[t0:t1], keys.transpose(-1, -2)).mul_(scale)        # [t, G, hpg, topk * bs]
        probs = torch.softmax(s.masked_fill_(hidden, -math.inf), -1).nan_to_num_(0.0)
        out[t0:t1] = torch.matmul(probs, vals)
    return out


def index_topk_cpu(iq: torch.Tensor, index_cache: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, block_tables: torch.Tensor, *, block_size: int, topk: int,
                   local_blocks: int, init_blocks: int = 0) -> torch.Tensor:
    """Same contract as `index_topk_ref` (iq: [T, Hi, Di]; index_cache: [num_blocks, block_size,
    Di]) -> [T, Hi, topk] int32: the chosen logical block ids, -1 padded."""
    T, Hi, Di = iq.shape
    bs = block_size
    exact = exact_positions()
    res = torch.full((T, Hi, topk), -1, dtype=torch.int32)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, L in enumerate(lens):
        qs, qe = qsl[r], qsl[r + 1]
        first = L - (qe - qs)
        split = qs + min(qe - qs, max(0, exact - first))
        queries = iq[qs:qe]
        if index_cache.dtype == torch.float8_e4m3fn:   # fp8 index cache: the queries cast alike
            queries = queries.to(torch.float8_e4m3fn)
        for a, b, acc in ((qs, split, torch.float64), (split, qe, torch.float32)):
            if a == b:
                continue
            n_keys = L - (qe - b)
            keys = _context(index_cache, block_tables[r], n_keys, acc)           # [nb * bs, Di]
            choose = _topk_exact if acc == torch.float64 else _topk_fast
            res[a:b] = choose(queries[a - qs:b - qs].to(acc), keys, first + a - qs, bs, topk,
                              local_blocks, init_blocks)
    return res


def _force(scores: torch.Tensor, own: torch.Tensor, local_blocks: int, init_blocks: int) -> None:
    """scores: [t, Hi, n] block scores; own: [t] each query's block. Sets +inf on the blocks a
    query must keep: its local window (blocks own - local_blocks + 1 .. own, the ones below 0
    clamped onto block 0, which the window then holds) and the init blocks up to its own."""
    t, Hi, n = scores.shape
    for j in range(local_blocks):
        scores.scatter_(-1, (own - j).clamp(min=0)[:, None, None].expand(t, Hi, 1), math.inf)
    init = min(init_blocks, n)
    if init:
        keep = torch.arange(init)[None, :] <= own[:, None]                  # [t, init]
        scores[..., :init].masked_fill_(keep[:, None, :], math.inf)


def _topk_exact(queries, keys, first, bs, topk, local_blocks, init_blocks) -> torch.Tensor:
    """fp64 block scores as the reference computes them: queries [Tq, Hi, Di] at positions
    [first, first + Tq), keys [n * bs, Di] -> [Tq, Hi, topk] int32."""
    Tq, Hi, _ = queries.shape
    res = torch.full((Tq, Hi, topk), -1, dtype=torch.int32)
    tile = max(1, _TILE_BYTES // (Hi * keys.shape[0] * 8))
    for t0 in range(0, Tq, tile):
        t1 = min(Tq, t0 + tile)
        p0, p1 = first + t0, first + t1
        nb = -(-p1 // bs)                                                 # blocks the tile sees
        s = torch.matmul(queries[t0:t1], keys[:nb * bs].T)               # [t, Hi, nb * bs]
        q_pos = torch.arange(p0, p1)
        s[:, :, p0:].masked_fill_((torch.arange(p0, nb * bs)[None, :] > q_pos[:, None])[:, None, :], -math.inf)
        scores = s.view(t1 - t0, Hi, nb, bs).amax(-1)                      # [t, Hi, nb]
        _force(scores, q_pos // bs, local_blocks, init_blocks)
        k = min(topk, nb)
        vals, ids = torch.topk(scores, k, dim=-1)
        res[t0:t1, :, :k] = ids.masked_fill(vals == -math.inf, -1).to(torch.int32)
    return res


def _topk_fast(queries, keys, first, bs, topk, local_blocks, init_blocks) -> torch.Tensor:
    """fp32 block scores: queries [Tq, Hi, Di] at positions [first, first + Tq), keys
    [n * bs, Di] -> [Tq, Hi, topk] int32. Keys go offset-major ([bs, n, Di]), so one batched
    product gives a tile's scores as [bs, rows, n] and a block's max is an elementwise max over
    the leading dimension, into a reused buffer."""
    Tq, Hi, Di = queries.shape
    n_all = keys.shape[0] // bs
    by_offset = keys.view(n_all, bs, Di).transpose(0, 1).contiguous()    # [bs, n_all, Di]
    res = torch.full((Tq, Hi, topk), -1, dtype=torch.int32)
    tile = max(1, min(Tq, _FAST_TILE_BYTES // (bs * Hi * n_all * 4)))
    buf = torch.empty(bs * tile * Hi * n_all)
    for t0 in range(0, Tq, tile):
        t1 = min(Tq, t0 + tile)
        t, p0, p1 = t1 - t0, first + t0, first + t1
        nb, b0 = -(-p1 // bs), p0 // bs                  # blocks the tile sees; the first one masked
        s = buf[:bs * t * Hi * nb].view(bs, t, Hi, nb)
        torch.matmul(queries[t0:t1].reshape(1, t * Hi, Di), by_offset[:, :nb].transpose(1, 2),
                     out=s.view(bs, t * Hi, nb))
        q_pos = torch.arange(p0, p1)
        key_pos = torch.arange(bs)[:, None] + torch.arange(b0, nb)[None, :] * bs          # [bs, nb - b0]
        s[..., b0:].masked_fill_((key_pos[:, None, :] > q_pos[None, :, None])[:, :, None, :], -math.inf)
        scores = s.amax(0)                                                # [t, Hi, nb]
        _force(scores, q_pos // bs, local_blocks, init_blocks)
        k = min(topk, nb)
        vals, ids = torch.topk(scores, k, dim=-1)
        res[t0:t1, :, :k] = ids.masked_fill(vals == -math.inf, -1).to(torch.int32)
    return res
