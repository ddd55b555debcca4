"""One rank's CPU tier: a host copy of every cache plane indexed by block id (each layer's K
and V, each sparse layer's index keys, the draft's caches), and the copies the scheduler asks
for (`KVOffloadWork`), each a gather/scatter of whole blocks byte for byte: the worker side of
the CPU tier's KV connector ("cpu_tier").

On a GPU the tier is pinned host memory and the copies run on a side stream, after the work
already queued on the compute stream (which wrote the blocks), so they overlap the step's
forward; an event per batch tells when it is over (`poll`). On the CPU they are plain copies,
over when `submit` returns.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from m3serve.core.kv_connector.base import KVConnectorWorker, as_struct
from m3serve.core.scheduler_output import KVOffloadReport, KVOffloadWork


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(start index, end index, first slot) of each run of consecutive slots."""
    out, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            out.append((start, i, slots[start]))
            start = i
    return out


class KVOffloadWorker(KVConnectorWorker):
    """Host slots [num_slots, *block shape] for each plane of `planes` ((cache group name,
    device tensor whose dim 0 is the block id)), and the copies between them."""

    name = "cpu_tier"

    def __init__(self, planes: list[tuple[str, torch.Tensor]], num_slots: int, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.groups = [name for name, _ in planes]
        # byte views: a copy is bit-exact whatever the dtype (fp8 included)
        self.device_planes = [t.view(torch.uint8) for _, t in planes]
        self.host_planes = [torch.empty((num_slots, *t.shape[1:]), dtype=torch.uint8, pin_memory=self.cuda)
                            for t in self.device_planes]
        self.num_slots = num_slots
        self.bytes_per_block = sum(t[0].numel() for t in self.device_planes)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._events: deque[tuple] = deque()   # per batch in flight: (start, stores over, loads over)
        self.num_done = 0
        self.seconds_to_cpu = 0.0
        self.seconds_to_gpu = 0.0

    def start(self, work: KVOffloadWork) -> None:
        """The step's batch, on the side stream: it overlaps the forward."""
        self.submit(as_struct(work, KVOffloadWork))

    def report(self) -> KVOffloadReport:
        """Batches over on this rank and the copy times (the scheduler side takes the smallest
        count over the ranks)."""
        return KVOffloadReport(self.poll(), self.seconds_to_cpu, self.seconds_to_gpu)

    def submit(self, work: KVOffloadWork) -> None:
        """Start one batch: the stores, then the loads."""
        if not work.has_copies:
            return
        if not self.cuda:
            t0 = time.perf_counter()
            self._store(work.store_block_ids, work.store_slots)
            t1 = time.perf_counter()
            self._load(work.load_slots, work.load_block_ids)
            self.seconds_to_cpu += t1 - t0
            self.seconds_to_gpu += time.perf_counter() - t1
            self.num_done += 1
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))    # the forwards that wrote the blocks
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            events[0].record(self.stream)
            self._store(work.store_block_ids, work.store_slots)
            events[1].record(self.stream)
            self._load(work.load_slots, work.load_block_ids)
            events[2].record(self.stream)
        self._events.append(events)

    def _store(self, block_ids: list[int], slots: list[int]) -> None:
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        runs = _runs(slots)
        for device_plane, host_plane in zip(self.device_planes, self.host_planes):
            staged = device_plane.index_select(0, index)           # [n, *block shape]
            for i, j, slot in runs:
                host_plane[slot:slot + j - i].copy_(staged[i:j], non_blocking=True)

    def _load(self, slots: list[int], block_ids: list[int]) -> None:
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        runs = _runs(slots)
        for device_plane, host_plane in zip(self.device_planes, self.host_planes):
            staged = torch.empty((len(slots), *host_plane.shape[1:]), dtype=torch.uint8, device=self.device)
            for i, j, slot in runs:
                staged[i:j].copy_(host_plane[slot:slot + j - i], non_blocking=True)
            device_plane.index_copy_(0, index, staged)

    def poll(self) -> int:
        """Batches completed since start (in submission order); never waits."""
        while self._events and self._events[0][2].query():
            start, stored, loaded = self._events.popleft()
            self.seconds_to_cpu += start.elapsed_time(stored) / 1000
            self.seconds_to_gpu += stored.elapsed_time(loaded) / 1000
            self.num_done += 1
        return self.num_done

    def shutdown(self) -> None:
        """Wait for the copies in flight, so that no copy outlives the memory it uses."""
        if self.stream is not None:
            self.stream.synchronize()
        self._events.clear()
