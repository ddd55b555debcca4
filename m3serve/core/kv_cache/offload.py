"""The scheduler's half of the CPU tier: which GPU blocks are copied out, which CPU slots are
copied back, and the references that keep both ends of every copy alive until it is over.

Stores are eager: when a request lets go of a prefix-cached block it was the last to hold, the
block is copied to the tier at once, on the workers' side stream, while it still sits in the
GPU pool (it can still be hit there). Copying at eviction instead would put the copy on the
critical path of the step that reuses the block (its forward overwrites the page), and a block
evicted without a copy is lost. The store holds a reference on the GPU block until the copy is
over, so the block is never both free and in flight; the CPU slot is pinned as long.

Loads bring a prefix the GPU pool lost back into fresh blocks of the request that asked for it;
the request waits outside the queue (`RequestStatus.WAITING_FOR_KV`) holding those blocks,
its slots pinned. The workers report how many batches they have finished (`complete`).
`CPUTierConnector` is the tier as the scheduler sees it: one KV connector among others.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from m3serve.core.kv_cache.block_pool import BlockPool, KVBlock
from m3serve.core.kv_cache.cpu_tier import CPUBlockTier
from m3serve.core.kv_connector.base import ExternalHit, KVConnectorScheduler, as_struct
from m3serve.core.scheduler_output import KVOffloadReport, KVOffloadWork


@dataclass
class _Batch:
    stores: list[tuple[KVBlock, int]] = field(default_factory=list)        # (GPU block, CPU slot)
    loads: list[tuple[str, list[int], list[int]]] = field(default_factory=list)  # (request, slots, block ids)


@dataclass
class KVOffloadStats:
    """Counters of the CPU tier (tokens and blocks since start)."""
    queries: int = 0          # prompt tokens of requests looked up in the tier
    hits: int = 0             # ... of them loaded from the tier
    blocks_to_cpu: int = 0
    blocks_to_gpu: int = 0
    seconds_to_cpu: float = 0.0
    seconds_to_gpu: float = 0.0


class KVOffloadManager:
    """Books of the copies between `pool` and a CPU tier of `num_slots` blocks."""

    def __init__(self, pool: BlockPool, num_slots: int):
        self.pool = pool
        self.tier = CPUBlockTier(num_slots)
        self.stats = KVOffloadStats()
        self._pending = _Batch()
        self._in_flight: deque[_Batch] = deque()
        self._num_sent = 0              # batches sent to the workers
        self._num_done = 0              # ... that they have finished
        self._storing: set[int] = set()    # GPU block ids with a store pending or in flight

    # ------------------------------------------------------------ stores

    def on_free(self, blocks: list[KVBlock]) -> None:
        """A request is about to drop its references on `blocks` (in sequence order): copy out
        the prefix-cached ones it was the last to hold, taking a reference for the copy."""
        for block in blocks:
            if block.block_hash is None or block.ref_cnt != 1 or block.block_id in self._storing:
                continue
            if block.block_hash in self.tier:
                self.tier.touch(block.block_hash)
                continue
            slot = self.tier.store_slot(block.block_hash)
            if slot is None:
                continue                 # every slot is pinned by copies in flight: skip this one
            self.pool.touch([block])
            self._storing.add(block.block_id)
            self._pending.stores.append((block, slot))

    @property
    def num_stores_in_flight(self) -> int:
        return len(self._storing)

    # ------------------------------------------------------------ loads

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """Slots of the leading run of `block_hashes` held by the tier."""
        return self.tier.lookup(block_hashes)

    def start_load(self, request_id: str, slots: list[int], block_ids: list[int]) -> None:
        """Copy `slots` into the request's fresh GPU blocks `block_ids` (same length)."""
        if len(slots) != len(block_ids):
            raise RuntimeError(f"load of {len(slots)} CPU slots into {len(block_ids)} GPU blocks")
        self.tier.pin(slots)
        self._pending.loads.append((request_id, list(slots), list(block_ids)))

    # ------------------------------------------------------------ the workers

    @property
    def has_work(self) -> bool:
        """Copies are to be sent or in flight: the engine must keep stepping."""
        return bool(self._pending.stores or self._pending.loads or self._in_flight)

    def take_work(self) -> KVOffloadWork | None:
        """The copies of the step being scheduled, as one batch (None: nothing to do)."""
        batch, self._pending = self._pending, _Batch()
        if batch.stores or batch.loads:
            self._in_flight.append(batch)
            self._num_sent += 1
            return KVOffloadWork(
                store_block_ids=[b.block_id for b, _ in batch.stores], store_slots=[s for _, s in batch.stores],
                load_slots=[s for _, slots, _ in batch.loads for s in slots],
                load_block_ids=[b for _, _, ids in batch.loads for b in ids], poll=True)
        if self._in_flight:
            return KVOffloadWork(poll=True)
        return None

    def complete(self, report: KVOffloadReport) -> list[str]:
        """Apply the workers' report: the copies of finished batches release their GPU blocks
        and CPU slots. Returns the requests whose loads are over."""
        if report.num_batches_done > self._num_sent:
            raise RuntimeError(f"the workers report {report.num_batches_done} offload batches done, "
                               f"but only {self._num_sent} were sent")
        self.stats.seconds_to_cpu = report.seconds_to_cpu
        self.stats.seconds_to_gpu = report.seconds_to_gpu
        loaded = []
        while self._num_done < report.num_batches_done:
            batch = self._in_flight.popleft()
            self._num_done += 1
            if batch.stores:
                self.tier.unpin([s for _, s in batch.stores])
                blocks = [b for b, _ in batch.stores]
                self._storing.difference_update(b.block_id for b in blocks)
                self.pool.free_blocks(blocks)
                self.stats.blocks_to_cpu += len(blocks)
            for request_id, slots, _ in batch.loads:
                self.tier.unpin(slots)
                self.stats.blocks_to_gpu += len(slots)
                loaded.append(request_id)
        return loaded

    # ------------------------------------------------------------ checks

    def references(self) -> tuple[dict[int, int], dict[int, int]]:
        """(GPU block id -> references held by stores, CPU slot -> pins held by copies)."""
        refs: dict[int, int] = {}
        pins: dict[int, int] = {}
        for batch in [self._pending, *self._in_flight]:
            for block, slot in batch.stores:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
                pins[slot] = pins.get(slot, 0) + 1
            for _, slots, _ in batch.loads:
                for slot in slots:
                    pins[slot] = pins.get(slot, 0) + 1
        return refs, pins

    def load_targets(self) -> dict[str, list[int]]:
        """Request id -> GPU blocks its loads (pending or in flight) write into."""
        out: dict[str, list[int]] = {}
        for batch in [self._pending, *self._in_flight]:
            for request_id, _, block_ids in batch.loads:
                out.setdefault(request_id, []).extend(block_ids)
        return out


class CPUTierConnector(KVConnectorScheduler):
    """The CPU tier's scheduler side as a KV connector (its books stay with the KV manager,
    which stores freed prefix-cached blocks eagerly): a prefix the GPU pool lost is an optional
    load of the blocks past the GPU hit that the tier holds; the ranks' work each step is a
    `KVOffloadWork` batch, their reports `KVOffloadReport`s (a batch is over when it is over on
    every rank: the smallest count)."""

    name = "cpu_tier"

    def __init__(self, kv_manager):
        self.kv = kv_manager
        self._lookup: tuple[str, list[int]] | None = None    # the last hit answered: (request, slots)
        self._loaded: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens, hit_blocks, count=True):
        slots = self.kv.get_cpu_hits(request, len(hit_blocks), count)
        if not slots:
            return None
        self._lookup = (request.request_id, slots)
        return ExternalHit(len(slots) * self.kv.block_size, optional=True,
                           blocks_come_back=self.kv.has_offload_work)

    def start_load(self, request, block_ids, num_computed_tokens):
        rid, slots = self._lookup
        if rid != request.request_id:
            raise RuntimeError(f"CPU-tier load of {request.request_id!r}, but the last lookup was {rid!r}")
        self._lookup = None
        first = num_computed_tokens // self.kv.block_size
        self.kv.offload.start_load(rid, slots, block_ids[first:first + len(slots)])
        self.kv.offload.stats.hits += len(slots) * self.kv.block_size

    def take_finished_loads(self):
        loaded, self._loaded = self._loaded, []
        return [(rid, None) for rid in loaded]

    def on_load_end(self, request, failure):
        self.kv.cache_blocks(request, request.num_computed_tokens)   # others may hit them now
        return None

    def build_metadata(self):
        return self.kv.take_offload_work()

    def update(self, reports):
        reports = [as_struct(r, KVOffloadReport) for r in reports]
        driver = reports[0]
        self._loaded += self.kv.complete_offload(KVOffloadReport(
            min(r.num_batches_done for r in reports), driver.seconds_to_cpu, driver.seconds_to_gpu))

    @property
    def has_pending(self):
        return self.kv.has_offload_work

    @property
    def needs_fast_poll(self):
        return self.kv.has_offload_work

    @property
    def has_blocks_in_flight(self):
        return bool(self.kv.offload.num_stores_in_flight)
