"""The KV blocks of a sliding-window draft (DSpark) in a pool of its own: each running request
holds only the blocks its next draft queries can read, not its whole context.

A draft query block after a step reads keys no older than `lo = c' - k - W + 1` (c' = the tokens
computed once the step is over, k = the drafts per step, W = the draft's sliding window; the
last verified position is at least c' - 1 - k). So a request holds the logical blocks covering
[lo, c' + k) (its query block writes at most k positions past c'); blocks wholly below `lo` go
back to the pool as the request advances, and context tokens below `lo` are written to the null
block (the draft never reads them). `lo` never moves back past a released block: every later
query starts after the last verified position. At most `window_blocks_per_request` blocks per
request, so a pool of `specs.window_pool_blocks` never runs dry while max_num_seqs requests run.

Full draft blocks are prefix-cached under the same content hashes as the target's blocks: a
prefix hit also finds the draft blocks of the hit's last window while they are still cached.
Draft KV that no step wrote for this request and no hit found (a partial hit, KV restored from
the CPU tier or pulled from a prefill worker, which carry no draft KV) is a hole: every position
below the request's `valid_from` is one, and its queries never read below it (drafts lose
quality, the output stays lossless since every draft is verified). So are the tokens of steps
that run without the draft (`core/spec_gate.py`: disable_by_batch_size, or where drafts measure
slower): `valid_from` moves past them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from m3serve.core.kv_cache.block_pool import BlockPool, KVBlock
from m3serve.core.kv_cache.specs import window_blocks_per_request
from m3serve.core.request import Request
from m3serve.core.scheduler_output import DraftBlocks


@dataclass
class _DraftRow:
    """One request's draft blocks: logical blocks first .. first + len(blocks) - 1, contiguous."""
    first: int
    valid_from: int                  # positions below hold no draft KV of this request's prefix
    blocks: list[KVBlock] = field(default_factory=list)
    cached_end: int = 0              # logical blocks below this are registered (or never will be)
    sent_end: int = 0                # the workers' table holds blocks up to here

    @property
    def end(self) -> int:
        return self.first + len(self.blocks)


class DraftWindowManager:
    """The draft's pool and per-request windows, beside the target's `KVCacheManager` (which
    calls `allocate`, `cache_blocks` and `free`); `take_update` is each step's table diff."""

    def __init__(self, num_blocks: int, block_size: int, window: int, num_lookahead: int,
                 enable_caching: bool = True):
        if window <= 0:
            raise ValueError(f"a window draft needs a positive sliding window, got {window}")
        self.block_size, self.window, self.num_lookahead = block_size, window, num_lookahead
        self.pool = BlockPool(num_blocks, enable_caching)
        self.max_blocks_per_request = window_blocks_per_request(window, num_lookahead, block_size)
        self._rows: dict[str, _DraftRow] = {}
        self.num_hit_blocks = 0          # draft blocks found by prefix hits (tests, metrics)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def request_ids(self) -> list[str]:
        return list(self._rows)

    def allocate(self, request: Request, num_computed: int, num_new: int,
                 num_hit_blocks: int = 0) -> None:
        """The step computes [num_computed, num_computed + num_new) of `request`; its first
        `num_hit_blocks` blocks are a fresh prefix hit (the target's). Releases the blocks the
        window has left and takes the ones the step writes. Never fails (the pool holds every
        running request's window): RuntimeError if it would."""
        bs = self.block_size
        end_pos = num_computed + num_new                       # c'
        lo = max(0, end_pos - self.num_lookahead - self.window + 1)
        last = (end_pos + self.num_lookahead - 1) // bs        # block of the query block's last position
        row = self._rows.get(request.request_id)
        if row is None:
            row = self._new_row(request, num_computed, num_hit_blocks, lo)
            self._rows[request.request_id] = row
        drop = min(len(row.blocks), max(0, lo // bs - row.first))
        if drop:
            released, row.blocks = row.blocks[:drop], row.blocks[drop:]
            self.pool.free_blocks(released)
            row.first += drop
        if not row.blocks:
            row.first = max(row.first, lo // bs)
        need = last + 1 - row.end
        if need > 0:
            if need > self.pool.num_free_blocks:
                raise RuntimeError(f"the draft's window pool is out of blocks for {request.request_id!r} "
                                   f"({need} needed, {self.pool.num_free_blocks} free): it is sized for "
                                   f"fewer running requests")
            row.blocks += self.pool.get_new_blocks(need)

    def _new_row(self, request: Request, num_computed: int, num_hit_blocks: int, lo: int) -> _DraftRow:
        """A request's first draft blocks: the trailing run of its hit blocks in the window that
        the draft pool still caches; below that run (or below `num_computed` without one), holes."""
        bs = self.block_size
        run: list[KVBlock] = []
        for b in range(num_hit_blocks - 1, lo // bs - 1, -1):
            block = self.pool.get_cached_block(request.block_hashes[b])
            if block is None:
                break
            run.append(block)
        run.reverse()
        if run:
            self.pool.touch(run)
            self.num_hit_blocks += len(run)
            first = num_hit_blocks - len(run)
            return _DraftRow(first=first, valid_from=first * bs, blocks=run, cached_end=num_hit_blocks)
        first = max(lo, num_computed) // bs
        return _DraftRow(first=first, valid_from=num_computed, cached_end=-(-num_computed // bs))

    def not_written(self, request_id: str, end_pos: int) -> None:
        """The step computes up to `end_pos` without the draft (a plain step,
        `disable_by_batch_size`): what it computes is a hole for the draft."""
        row = self._rows.get(request_id)
        if row is not None:
            row.valid_from = max(row.valid_from, end_pos)

    def cache_blocks(self, request: Request, num_computed: int) -> None:
        """Register the request's full draft blocks within its first `num_computed` tokens
        (`request.block_hashes` is up to date: the target's manager has just hashed them)."""
        row = self._rows.get(request.request_id)
        if row is None:
            return
        bs = self.block_size
        start = max(row.cached_end, row.first, -(-row.valid_from // bs))
        stop = min(num_computed // bs, row.end, len(request.block_hashes))
        if stop <= start:
            return
        self.pool.cache_full_blocks(row.blocks[start - row.first:stop - row.first],
                                    request.block_hashes[start:stop], 0, stop - start)
        row.cached_end = stop

    def take_update(self, request_id: str) -> DraftBlocks | None:
        """The request's table diff since the last one (None: it holds no draft blocks)."""
        row = self._rows.get(request_id)
        if row is None:
            return None
        start = max(row.sent_end, row.first)
        update = DraftBlocks(row.first, [b.block_id for b in row.blocks[start - row.first:]], row.valid_from)
        row.sent_end = row.end
        return update

    def free(self, request_id: str) -> None:
        """Release every draft block of the request (full ones stay cached). Idempotent."""
        row = self._rows.pop(request_id, None)
        if row is not None and row.blocks:
            self.pool.free_blocks(row.blocks)

    def get_block_ids(self, request_id: str) -> dict[int, int]:
        """Logical block -> draft block id of what the request holds (tests, checks)."""
        row = self._rows.get(request_id)
        return {} if row is None else {row.first + i: b.block_id for i, b in enumerate(row.blocks)}

    def check_integrity(self) -> list[str]:
        """Inconsistencies (empty = fine) of the rows; the pool's own check raises."""
        problems, expected = [], {}
        for request_id, row in self._rows.items():
            if len(row.blocks) > self.max_blocks_per_request:
                problems.append(f"request {request_id!r} holds {len(row.blocks)} draft blocks, more "
                                f"than a window's {self.max_blocks_per_request}")
            if row.first < 0 or row.sent_end > row.end:
                problems.append(f"request {request_id!r}: draft blocks from {row.first}, "
                                f"sent up to {row.sent_end}, held up to {row.end}")
            for b in row.blocks:
                expected[b.block_id] = expected.get(b.block_id, 0) + 1
        try:
            self.pool.check_integrity(expected)
        except RuntimeError as e:
            problems.append(f"draft window pool: {e}")
        return problems
