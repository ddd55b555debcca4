"""A KV tier for tests only: an in-memory store of whole blocks by content hash, shared by every
engine that is given it (the shape of a disk tier or Mooncake's store), written and read through
the KV-connector interface alone. Finished requests' full blocks are stored; a waiting request
whose blocks past its GPU prefix hit the store holds gets them loaded. The scheduler needs no
change for it: the engine is handed its two sides (`EngineCore(..., kv_connectors=...)` and the
worker's `kv_connector`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from m3serve.core.kv_connector import ExternalHit, KVConnectorScheduler, KVConnectorWorker, as_struct


class MemoryWork(msgspec.Struct):
    store_block_ids: list[int] = []
    store_keys: list[bytes] = []
    load_keys: list[bytes] = []
    load_block_ids: list[int] = []
    load_request_ids: list[str] = []


class MemoryReport(msgspec.Struct):
    stored_keys: list[bytes] = []
    loaded_request_ids: list[str] = []


@dataclass
class MemoryStats:
    queries: int = 0          # lookups
    hit_tokens: int = 0       # tokens whose KV a load brings
    blocks_stored: int = 0
    blocks_loaded: int = 0
    loads_done: int = 0


@dataclass
class MemoryStore:
    """The bytes (worker side) and the index of what is complete (scheduler side)."""
    data: dict[bytes, list[torch.Tensor]] = field(default_factory=dict)
    index: set[bytes] = field(default_factory=set)


class MemoryTierScheduler(KVConnectorScheduler):
    name = "memory"

    def __init__(self, store: MemoryStore, block_size: int):
        self.store, self.block_size = store, block_size
        self.stats = MemoryStats()
        self._pending = MemoryWork()
        self._sent: list[MemoryWork] = []
        self._answer: tuple[str, list[bytes]] | None = None
        self._finished: list[tuple[str, str | None]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens, hit_blocks, count=True):
        max_blocks = (request.num_tokens - 1) // self.block_size      # the last token is computed
        keys = []
        for key in request.block_hashes[len(hit_blocks):max_blocks]:
            if key not in self.store.index:
                break
            keys.append(key)
        self.stats.queries += count
        if not keys:
            return None
        self._answer = (request.request_id, keys)
        return ExternalHit(len(keys) * self.block_size, blocks_come_back=self.has_pending)

    def start_load(self, request, block_ids, num_computed_tokens):
        rid, keys = self._answer
        assert rid == request.request_id
        first = num_computed_tokens // self.block_size
        self._pending.load_keys += keys
        self._pending.load_block_ids += block_ids[first:first + len(keys)]
        self._pending.load_request_ids.append(rid)
        self.stats.hit_tokens += len(keys) * self.block_size

    def request_finished(self, request, block_ids):
        # full blocks with computed KV; copied out before the next step's forward can reuse them
        num_full = min(len(request.block_hashes), request.num_computed_tokens // self.block_size, len(block_ids))
        queued = set(self._pending.store_keys)
        for block_id, key in zip(block_ids[:num_full], request.block_hashes[:num_full]):
            if key not in self.store.index and key not in queued:
                self._pending.store_block_ids.append(block_id)
                self._pending.store_keys.append(key)
                queued.add(key)
        # returns None: nothing is kept, the blocks are freed as usual

    def build_metadata(self):
        work, self._pending = self._pending, MemoryWork()
        if not (work.store_keys or work.load_keys):
            return None
        self._sent.append(work)
        return work

    def update(self, reports):
        report = as_struct(reports[0], MemoryReport)
        self.store.index.update(report.stored_keys)
        self.stats.blocks_stored += len(report.stored_keys)
        for work in self._sent:      # the worker copies synchronously: every batch sent is over
            self.stats.blocks_loaded += len(work.load_keys)
        self._sent.clear()
        self.stats.loads_done += len(report.loaded_request_ids)
        self._finished += [(rid, None) for rid in report.loaded_request_ids]

    def take_finished_loads(self):
        out, self._finished = self._finished, []
        return out

    @property
    def has_pending(self):
        return bool(self._pending.store_keys or self._pending.load_keys or self._sent or self._finished)

    @property
    def needs_fast_poll(self):
        return self.has_pending


class MemoryTierWorker(KVConnectorWorker):
    """Copies whole blocks of every cache plane (`Worker.cache_planes()`) to and from the store."""
    name = "memory"

    def __init__(self, store: MemoryStore, planes: list[tuple[str, torch.Tensor]]):
        self.store, self.planes = store, [t for _, t in planes]
        self._report = MemoryReport()

    def start(self, metadata):
        work = as_struct(metadata, MemoryWork)
        for block_id, key in zip(work.store_block_ids, work.store_keys):
            self.store.data[key] = [plane[block_id].clone() for plane in self.planes]
        for key, block_id in zip(work.load_keys, work.load_block_ids):
            for plane, saved in zip(self.planes, self.store.data[key]):
                plane[block_id].copy_(saved)
        self._report = MemoryReport(list(work.store_keys), list(work.load_request_ids))

    def report(self):
        report, self._report = self._report, MemoryReport()
        return report
