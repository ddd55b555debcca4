"""The worker's half of KV transfer over NIXL: one agent per rank, the rank's cache planes
registered once, and one-sided READs of a request's blocks from the producer ranks that hold
them (host memory on CPU, device memory on GPU; UCX underneath).

A pull is one transfer per producer rank it reads from. It ends when every transfer is DONE,
or fails when one reports an error or the pull outlives `transfer_timeout`; a failed pull is
reported only once all its transfers are released (cancelled), so nothing can still write into
its blocks when the scheduler reuses them.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from m3serve.config import KVTransferConfig
from m3serve.core.kv_connector.base import as_struct
from m3serve.disagg.connector import WorkerConnector
from m3serve.disagg.layout import LayoutMismatch, plan_pull
from m3serve.disagg.messages import EngineMetadata, KVConnectorMetadata, RankMetadata, RankResult, Region

logger = logging.getLogger(__name__)

_FAULT_OFFSET = 1 << 46      # test_fault "fail": addresses no agent registered


_GENTLE_PROGRESS_S = 0.0005


# NIXL's builds: the `nixl` package picks the one matching torch's CUDA; without it (one build
# installed alone, as the `test` extra does) its own order when no CUDA is found
_NIXL_BUILDS = ("nixl_cu13", "nixl_cu12")


def nixl_api():
    """NIXL's `_api` module: through the `nixl` package when it is installed, else from the one
    CUDA build installed alone (`nixl-cu13` or `nixl-cu12`). ImportError naming what to install."""
    import importlib

    try:
        return importlib.import_module("nixl._api")
    except ModuleNotFoundError as e:
        if e.name != "nixl":        # the package is there and its build is not: its message says which
            raise
    for build in _NIXL_BUILDS:
        try:
            return importlib.import_module(f"{build}._api")
        except ModuleNotFoundError as e:
            if e.name != build:
                raise
    raise ImportError("no NIXL: pip install nixl (or 'm3serve[disagg]')")


def _import_nixl():
    try:
        api = nixl_api()
    except ImportError as e:
        raise RuntimeError(f"--kv-transfer-config NixlConnector needs NIXL: pip install nixl ({e})") from None
    return api.nixl_agent, api.nixl_agent_config, api.nixl_thread_sync_t


@dataclass
class _Transfer:
    handle: object
    num_bytes: int
    released: bool = False


@dataclass
class _Pull:
    deadline: float
    started: float
    transfers: list[_Transfer] = field(default_factory=list)
    failure: str | None = None
    stalled: bool = False


class NixlWorkerConnector(WorkerConnector):
    def __init__(self, config: KVTransferConfig, tp_rank: int, device):
        nixl_agent, nixl_agent_config, sync = _import_nixl()
        self.config, self.tp_rank, self.device = config, tp_rank, device
        self.agent_name = f"m3serve-{config.engine_id}-tp{tp_rank}-{uuid.uuid4().hex[:8]}"
        # NIXL's progress thread spins a core: worth it beside a GPU. On a CPU-only host a
        # thread of ours drives progress every half millisecond instead (a producer's agent
        # must progress for a consumer's reads to complete).
        spin = config.progress_thread if config.progress_thread is not None else device.type == "cuda"
        if device.type == "cuda":
            # UCX turns CUDA-IPC reads off where it sees no NVLink (one GPU, PCIe-only hosts)
            # and would then move device memory over TCP through the host; a READ over IPC is
            # the fast path on every host that has it. An operator's own setting wins.
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(
            enable_prog_thread=spin, backends=list(config.backends),
            sync_mode=None if spin else sync.NIXL_THREAD_SYNC_STRICT))
        self._stop = threading.Event()
        self._progress = None
        if not spin:
            self._progress = threading.Thread(target=self._drive_progress, name="m3serve-nixl-progress",
                                              daemon=True)
            self._progress.start()
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        self.device_id = (device.index or 0) if device.type == "cuda" else 0
        self.regions: list[Region] = []
        self.block_size = 0
        self._remote: dict[str, tuple[EngineMetadata, dict[int, str]]] = {}   # engine -> (meta, agents)
        self._pulls: dict[str, _Pull] = {}
        self._result = RankResult(done=[], failed={}, xfer_seconds=[])

    def _drive_progress(self) -> None:
        while not self._stop.wait(_GENTLE_PROGRESS_S):
            try:
                self.agent.get_new_notifs()       # progresses the backends' workers
            except Exception as e:
                logger.warning("NIXL progress: %s", e)

    def register_kv_caches(self, planes) -> None:
        """planes: [(layer index, kv cache [2, NB, bs, H, D] | None, index cache [NB, bs, Di] | None,
        first global KV head, total KV heads)]."""
        tensors = []
        for layer, kv, index, head_start, total_heads in planes:
            if kv is not None:
                _, nb, bs, h, d = kv.shape
                size = kv.element_size()
                block = bs * h * d * size
                for plane, offset in (("k", 0), ("v", nb * block)):
                    self.regions.append(Region(f"{layer}.{plane}", kv.data_ptr() + offset, block, h * d * size,
                                               d * size, head_start, h, total_heads))
                tensors.append(kv)
                self.block_size = bs
            if index is not None:
                _, bs, di = index.shape
                size = index.element_size()
                self.regions.append(Region(f"{layer}.index", index.data_ptr(), bs * di * size, di * size,
                                           di * size, 0, 1, 1))
                tensors.append(index)
        for t in tensors:
            if not t.is_contiguous():
                raise RuntimeError("KV cache planes must be contiguous to be registered for transfer")
        self.agent.register_memory(tensors)

    def rank_metadata(self) -> RankMetadata:
        return RankMetadata(self.tp_rank, self.agent_name, self.agent.get_agent_metadata(), self.mem_type,
                            self.device_id, self.regions)

    # ------------------------------------------------------------ pulls

    def start(self, metadata: KVConnectorMetadata) -> None:
        metadata = as_struct(metadata, KVConnectorMetadata)
        for engine in metadata.remote_engines:
            if engine.engine_id in self._remote:
                continue
            agents = {}
            for rank in engine.ranks:
                agents[rank.tp_rank] = self.agent.add_remote_agent(rank.agent_metadata)
            self._remote[engine.engine_id] = (engine, agents)
        for job in metadata.recv:
            self._start(job)

    def _start(self, job) -> None:
        now = time.monotonic()
        pull = _Pull(deadline=now + self.config.transfer_timeout, started=now)
        self._pulls[job.request_id] = pull
        remote = self._remote.get(job.engine_id)
        if remote is None:
            pull.failure = f"no metadata of prefill engine {job.engine_id!r} on this rank"
            return
        engine, agents = remote
        regions = self.regions
        if self.config.test_fault == "skip_index":
            regions = [r for r in regions if not r.name.endswith(".index")]
        try:
            plan = plan_pull(regions, {r.tp_rank: r.regions for r in engine.ranks}, self.block_size,
                             job.local_block_ids, job.remote_block_ids, self.tp_rank)
        except (LayoutMismatch, ValueError) as e:
            pull.failure = f"cannot map the prefill worker's KV: {e}"
            return
        if self.config.test_fault == "stall":
            pull.stalled = True
            return
        ranks = {r.tp_rank: r for r in engine.ranks}
        for rank, (loc, rem, n) in plan.items():
            if self.config.test_fault == "fail":
                rem = rem + _FAULT_OFFSET
            src = ranks[rank]
            try:
                local = self.agent.get_xfer_descs(
                    np.stack([loc, n, np.full_like(n, self.device_id)], axis=1).astype(np.uint64), self.mem_type)
                far = self.agent.get_xfer_descs(
                    np.stack([rem, n, np.full_like(n, src.device_id)], axis=1).astype(np.uint64), src.mem_type)
                handle = self.agent.initialize_xfer("READ", local, far, agents[rank])
                transfer = _Transfer(handle, int(n.sum()))
                pull.transfers.append(transfer)
                state = self.agent.transfer(handle)
            except Exception as e:       # NIXL refuses descriptors it cannot serve
                pull.failure = f"NIXL could not post the read from prefill rank {rank}: {e}"
                return
            if state == "ERR":
                pull.failure = f"NIXL failed the read from prefill rank {rank}"
                return
            self._result.num_descriptors += len(n)

    def poll(self) -> RankResult:
        now = time.monotonic()
        for rid, pull in list(self._pulls.items()):
            if pull.failure is None:
                states = [] if pull.stalled else [self.agent.check_xfer_state(t.handle) for t in pull.transfers]
                if "ERR" in states:
                    pull.failure = "NIXL reported a failed read"
                elif states and all(s == "DONE" for s in states):
                    self._release(pull)
                    self._result.done.append(rid)
                    self._result.num_bytes += sum(t.num_bytes for t in pull.transfers)
                    self._result.xfer_seconds.append(now - pull.started)
                    del self._pulls[rid]
                    continue
                elif now > pull.deadline:
                    pull.failure = f"the pull timed out after {self.config.transfer_timeout:g} s"
            if pull.failure is not None and self._release(pull):
                self._result.failed[rid] = pull.failure
                del self._pulls[rid]
        result, self._result = self._result, RankResult(done=[], failed={}, xfer_seconds=[])
        return result

    def _release(self, pull: _Pull) -> bool:
        """Release (cancel if still running) every transfer of a pull; False while one cannot be."""
        for t in pull.transfers:
            if t.released:
                continue
            try:
                self.agent.release_xfer_handle(t.handle)
                t.released = True
            except Exception as e:
                logger.warning("a KV read cannot be cancelled yet (%s); retrying", e)
                return False
        return True

    def shutdown(self) -> None:
        self._stop.set()
        if self._progress is not None:
            self._progress.join(1.0)
        for pull in self._pulls.values():
            self._release(pull)
        self._pulls.clear()
