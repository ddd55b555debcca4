"""Where a request's KV lives on each rank, and which bytes a consumer rank pulls from which
producer rank: pure arithmetic over `messages.Region`s (no transport, no torch).

A plane's block is `block_size` token rows of `num_heads * head_bytes` bytes. When producer
and consumer ranks hold the same heads of a plane (equal TP, or the replicated index cache),
one descriptor moves a whole block; when their TP sizes differ, a consumer rank's heads come
from one or several producer ranks, one descriptor per token row and producer rank. Runs that
are contiguous on both sides are merged, so consecutive blocks travel as one descriptor.
"""
from __future__ import annotations

import numpy as np

from m3serve.disagg.messages import Region


class LayoutMismatch(ValueError):
    """Producer and consumer caches cannot be mapped onto each other."""


def check_compatible(local: list[Region], remote: list[Region], local_block_size: int,
                     remote_block_size: int) -> None:
    """Raise LayoutMismatch naming the first difference that makes a pull impossible."""
    if local_block_size != remote_block_size:
        raise LayoutMismatch(f"block size {remote_block_size} on the producer, {local_block_size} here")
    theirs = {r.name: r for r in remote}
    mine = {r.name: r for r in local}
    if set(theirs) != set(mine):
        missing = sorted(set(mine) - set(theirs))[:4]
        extra = sorted(set(theirs) - set(mine))[:4]
        raise LayoutMismatch(f"the producer's cache planes differ (missing there: {missing}, "
                             f"extra there: {extra}): another model or cache layout")
    for name, a in mine.items():
        b = theirs[name]
        if (a.head_bytes, a.total_heads) != (b.head_bytes, b.total_heads):
            raise LayoutMismatch(
                f"plane {name}: {b.total_heads} heads of {b.head_bytes} bytes on the producer, "
                f"{a.total_heads} of {a.head_bytes} here (another model, dtype or kv_cache_dtype)")


def _runs(local: Region, sources: list[tuple[int, Region]], preferred: int) -> list[tuple[int, Region, int, int]]:
    """Cover the local plane's heads with producer ranks: [(rank, region, first head, end)]."""
    runs: list[list] = []
    for g in range(local.head_start, local.head_start + local.num_heads):
        holders = [(rank, r) for rank, r in sources if r.head_start <= g < r.head_start + r.num_heads]
        if not holders:
            raise LayoutMismatch(f"plane {local.name}: no producer rank holds head {g}")
        rank, region = min(holders, key=lambda h: (h[0] != preferred, h[0]))
        if runs and runs[-1][0] == rank and runs[-1][3] == g:
            runs[-1][3] = g + 1
        else:
            runs.append([rank, region, g, g + 1])
    return [tuple(r) for r in runs]


def merge_descriptors(local: np.ndarray, remote: np.ndarray, length: np.ndarray):
    """Merge neighbours that are contiguous on both sides (input in transfer order)."""
    if len(length) <= 1:
        return local, remote, length
    joins = (local[:-1] + length[:-1] == local[1:]) & (remote[:-1] + length[:-1] == remote[1:])
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    return local[starts], remote[starts], np.add.reduceat(length, starts)


def plan_pull(local_regions: list[Region], remote_ranks: dict[int, list[Region]], block_size: int,
              local_blocks: list[int], remote_blocks: list[int], local_tp_rank: int,
              ) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Descriptors that fill `local_blocks` of every local plane from `remote_blocks` of the
    producer: {producer rank: (local addresses, remote addresses, lengths)}, int64 arrays."""
    if len(local_blocks) != len(remote_blocks):
        raise ValueError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks")
    lb = np.asarray(local_blocks, dtype=np.int64)
    rb = np.asarray(remote_blocks, dtype=np.int64)
    by_name = {}
    for rank, regions in remote_ranks.items():
        for r in regions:
            by_name.setdefault(r.name, []).append((rank, r))
    preferred = local_tp_rank % max(1, len(remote_ranks))
    parts: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    tokens = np.arange(block_size, dtype=np.int64)
    for plane in local_regions:
        sources = sorted(by_name.get(plane.name, []), key=lambda s: s[0])
        if not sources:
            raise LayoutMismatch(f"the producer has no plane {plane.name}")
        for rank, src, g0, g1 in _runs(plane, sources, preferred):
            local_row = plane.num_heads * plane.head_bytes
            remote_row = src.num_heads * src.head_bytes
            whole = (g0 == plane.head_start and g1 == plane.head_start + plane.num_heads
                     and g0 == src.head_start and g1 == src.head_start + src.num_heads
                     and plane.token_stride == local_row and src.token_stride == remote_row)
            if whole:      # the same heads, rows packed: one descriptor per block
                loc = plane.base + lb * plane.block_stride
                rem = src.base + rb * src.block_stride
                n = np.full(len(lb), block_size * local_row, dtype=np.int64)
            else:          # a slice of each token row
                loc = (plane.base + lb[:, None] * plane.block_stride + tokens[None, :] * plane.token_stride
                       + (g0 - plane.head_start) * plane.head_bytes).reshape(-1)
                rem = (src.base + rb[:, None] * src.block_stride + tokens[None, :] * src.token_stride
                       + (g0 - src.head_start) * src.head_bytes).reshape(-1)
                n = np.full(loc.shape, (g1 - g0) * plane.head_bytes, dtype=np.int64)
            parts.setdefault(rank, []).append((loc, rem, n))
    out = {}
    for rank, pieces in parts.items():
        loc = np.concatenate([p[0] for p in pieces])
        rem = np.concatenate([p[1] for p in pieces])
        n = np.concatenate([p[2] for p in pieces])
        out[rank] = merge_descriptors(loc, rem, n)
    return out
