"""Per-request KV block lists on top of the block pool: prefix hits, slot allocation, freeing.

Both cache groups (main K/V and the key-only index cache) share page size and block tables, so
one list of block ids per request covers them all. KV that arrives from elsewhere (a prefix hit
or a remote prefill) enters through the same `num_new_computed_tokens` argument. With a CPU tier
(`num_cpu_blocks`), freed prefix-cached blocks are copied out and lost prefixes loaded back
(`offload.py`). A sliding-window draft (DSpark) keeps its KV in a pool of its own, holding
only each running request's window (`draft_window.py`): `allocate_slots`, `cache_blocks` and
`free` keep it in step, `take_draft_update` is its table diff for the step.
"""
from __future__ import annotations

from m3serve.core.kv_cache.block_pool import BlockPool, KVBlock
from m3serve.core.kv_cache.draft_window import DraftWindowManager
from m3serve.core.kv_cache.hashing import request_block_hashes
from m3serve.core.kv_cache.offload import KVOffloadManager
from m3serve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns which blocks each request holds, and the prefix cache over full blocks.

    Block 0 is the pool's null block (never allocated), so `num_blocks - 1` blocks are usable.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_cpu_blocks: int = 0,
                 draft_window: int = 0, num_draft_blocks: int = 0, num_lookahead_tokens: int = 0):
        """`draft_window` > 0: a window draft's own pool of `num_draft_blocks` blocks, for
        requests that draft `num_lookahead_tokens` tokens per step."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.draft = (DraftWindowManager(num_draft_blocks, block_size, draft_window, num_lookahead_tokens,
                                         enable_caching) if draft_window else None)
        self.offload = KVOffloadManager(self.block_pool, num_cpu_blocks) if enable_caching and num_cpu_blocks else None
        self._req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0     # tokens found

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def capacity_tokens(self) -> int:
        """The tokens of KV the whole pool holds (its usable blocks)."""
        return self.block_pool.num_usable_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def _update_block_hashes(self, request: Request) -> None:
        request.block_hashes.extend(request_block_hashes(
            request.all_token_ids, self.block_size, request.cache_salt, request.block_hashes,
            request.mm_spans))

    def get_computed_blocks(self, request: Request, count: bool = True) -> tuple[list[KVBlock], int]:
        """Longest run of the request's leading full blocks found in the prefix cache.

        Returns the blocks (not yet referenced; pass them to `allocate_slots`) and the number of
        tokens they cover. The last token is never a hit, so the step that follows has logits to
        sample from. With `count`, the call counts towards `prefix_cache_queries` / `_hits`.
        """
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if count:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def get_cpu_hits(self, request: Request, num_gpu_hit_blocks: int, count: bool = True) -> list[int]:
        """CPU-tier slots of the request's full blocks that follow its GPU hit (the leading run
        the tier holds; the last token is never a hit). With `count`, the call counts towards
        the tier's queries (its hits count when a load starts)."""
        if self.offload is None:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if count:
            self.offload.stats.queries += request.num_tokens
        return self.offload.lookup(request.block_hashes[num_gpu_hit_blocks:max_hit_blocks])

    def start_load(self, request: Request, hit_blocks: list[KVBlock], num_hit: int, slots: list[int]) -> bool:
        """Give a fresh request blocks for its GPU hit plus `slots`, and queue the copy of the
        slots into its new blocks. False (nothing allocated): the pool cannot cover them."""
        num_loaded = len(slots) * self.block_size
        if self.allocate_slots(request, 0, num_hit + num_loaded, hit_blocks) is None:
            return False
        block_ids = self.get_block_ids(request.request_id)[len(hit_blocks):]
        self.offload.start_load(request.request_id, slots, block_ids)
        self.offload.stats.hits += num_loaded
        return True

    def take_offload_work(self):
        """The copies to and from the CPU tier for the step being scheduled (or None)."""
        return self.offload.take_work() if self.offload is not None else None

    def complete_offload(self, report) -> list[str]:
        """Apply the workers' report of finished copies; the requests whose loads are over."""
        return self.offload.complete(report) if self.offload is not None else []

    @property
    def num_offload_refs(self) -> int:
        """GPU block references and CPU slot pins held by copies pending or in flight."""
        if self.offload is None:
            return 0
        refs, pins = self.offload.references()
        return sum(refs.values()) + sum(pins.values())

    @property
    def has_offload_work(self) -> bool:
        return self.offload is not None and self.offload.has_work

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make the request's blocks cover its computed tokens plus this step's tokens.

        num_new_tokens: tokens the model computes this step (prompt chunk, decode token, drafts).
        num_new_computed_tokens: tokens whose KV is already present or arrives from elsewhere
            (prefix hit, remote prefill); they extend `request.num_computed_tokens`.
        new_computed_blocks: prefix-hit blocks from `get_computed_blocks`, covering the leading
            part of `num_new_computed_tokens`; only for a request that holds no blocks yet.
        num_lookahead_tokens: extra slots reserved beyond this step (e.g. for draft tokens), as
            many as the whole pool can hold beside the request's tokens (a request never needs
            more: its drafts stop where the pool ends, `Scheduler._usable_drafts`).

        Returns the ids of the blocks appended to the request's list (prefix hits first), or None
        if the free pool cannot cover them; on None nothing was allocated or referenced. With a
        window draft, a step that computes tokens (`num_new_tokens` > 0) also moves the
        request's draft window (`draft_window.py`; its pool never runs dry).
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                             f"num_new_computed_tokens={num_new_computed_tokens}, "
                             f"num_lookahead_tokens={num_lookahead_tokens}")
        new_computed_blocks = new_computed_blocks or []
        blocks = self._req_to_blocks.get(request.request_id, [])
        if new_computed_blocks and blocks:
            raise RuntimeError(f"request {request.request_id!r} already holds blocks; "
                               "prefix-hit blocks are only for a fresh request")
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_total_tokens = num_tokens + min(num_lookahead_tokens, max(0, self.capacity_tokens - num_tokens))
        num_required = cdiv(num_total_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # Hit blocks sitting in the free queue leave it when touched, so they use up free blocks.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.block_pool.num_free_blocks:
            return None

        self.block_pool.touch(new_computed_blocks)
        new_blocks = new_computed_blocks + self.block_pool.get_new_blocks(num_new_blocks)
        if request.request_id not in self._req_to_blocks:
            self._req_to_blocks[request.request_id] = blocks
            self._num_cached_blocks[request.request_id] = len(new_computed_blocks)
        blocks.extend(new_blocks)
        if self.draft is not None and num_new_tokens > 0:
            self.draft.allocate(request, request.num_computed_tokens + num_new_computed_tokens, num_new_tokens,
                                len(new_computed_blocks))
        return [b.block_id for b in new_blocks]

    def take_draft_update(self, request_id: str):
        """The window draft's table diff of the request for this step (None: no window draft,
        or the request holds no draft blocks)."""
        return self.draft.take_update(request_id) if self.draft is not None else None

    def free_draft(self, request: Request) -> None:
        """Release the request's draft window alone (a finished request whose target KV is
        held for a decode worker). Idempotent."""
        if self.draft is not None:
            self.draft.free(request.request_id)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that became full within its first `num_computed_tokens`."""
        if not self.enable_caching or request.request_id not in self._req_to_blocks:
            return
        self._update_block_hashes(request)
        if self.draft is not None:
            self.draft.cache_blocks(request, min(num_computed_tokens, request.num_tokens))
        blocks = self._req_to_blocks[request.request_id]
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(blocks))
        num_cached = self._num_cached_blocks[request.request_id]
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full)
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release all of the request's blocks (its draft window too); full ones stay in the
        prefix cache. Idempotent."""
        self.free_draft(request)
        blocks = self._req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            if self.offload is not None:
                self.offload.on_free(blocks)
            self.block_pool.free_blocks(blocks)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_to_blocks.get(request_id, [])]

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._req_to_blocks

    @property
    def request_ids(self) -> list[str]:
        """Requests that currently hold a block list (possibly empty)."""
        return list(self._req_to_blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, in both tiers; only when nothing is held or in flight."""
        if self.offload is not None and self.offload.has_work:
            return False
        if self.draft is not None and self.draft.pool.num_free_blocks != self.draft.pool.num_usable_blocks:
            return False
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.draft is not None:
            self.draft.pool.reset_prefix_cache()
        return self.offload.tier.reset() if self.offload is not None else True

    def check_integrity(self) -> None:
        """Raise RuntimeError if refcounts disagree with the block lists the requests hold."""
        expected: dict[int, int] = {}
        problems = []
        for request_id, blocks in self._req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            if len(set(ids)) != len(ids):
                problems.append(f"request {request_id!r} holds a block twice: {ids}")
            for block_id in ids:
                expected[block_id] = expected.get(block_id, 0) + 1
            if self._num_cached_blocks.get(request_id, 0) > len(blocks):
                problems.append(f"request {request_id!r}: more cached blocks than blocks")
        if set(self._num_cached_blocks) != set(self._req_to_blocks):
            problems.append("cached-block counters and block lists track different requests")
        if self.offload is not None:
            store_refs, pins = self.offload.references()
            for block_id, n in store_refs.items():
                expected[block_id] = expected.get(block_id, 0) + n
            problems += self.offload.tier.check_integrity(pins)
            for request_id, block_ids in self.offload.load_targets().items():
                held = set(self.get_block_ids(request_id))
                if not set(block_ids) <= held:
                    problems.append(f"a load writes into blocks {sorted(set(block_ids) - held)} that "
                                    f"request {request_id!r} does not hold")
        if self.draft is not None:
            problems += self.draft.check_integrity()
            orphans = set(self.draft.request_ids) - set(self._req_to_blocks)
            if orphans:
                problems.append(f"requests hold draft blocks but no target blocks: {sorted(orphans)}")
        if problems:
            raise RuntimeError("KV cache manager integrity check failed:\n  " + "\n  ".join(problems))
        self.block_pool.check_integrity(expected)
