"""The scheduler's half of P/D KV transfer (`KVTransferScheduler`, transport-agnostic: a
`core.kv_connector` connector named "nixl") and the interface of the worker's half
(`WorkerConnector`, one per rank: NIXL in `nixl_worker`).

Producer (kv_producer / kv_both): a finished request that asked for `do_remote_decode` is held
(its blocks stay referenced) and answered with `kv_transfer_params`; the side channel's
`Claim` checks a consumer's params against the hold and extends it, `Release` (or the abort
timeout) frees it.

Consumer (kv_consumer / kv_both): a request carrying `do_remote_prefill` gets its blocks, then
claims the remote KV over the side channel (on a thread), then every rank pulls its share
(`RecvJob`s in the step's `KVConnectorMetadata`), reporting back in `RankResult`s. When every
rank has reported, the pull is over: done (the request starts with the prompt's KV in place but
its last token) or failed (the scheduler recomputes it, or fails it). Either way the producer is
told to release. A request aborted meanwhile keeps its blocks until no rank can still write
into them.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from m3serve import envs
from m3serve.config import KVTransferConfig
from m3serve.core.kv_connector.base import ExternalHit, KVConnectorScheduler, KVConnectorWorker, as_struct
from m3serve import kv_transfer_params as kvp
from m3serve.disagg.layout import LayoutMismatch, check_compatible
from m3serve.disagg.messages import (Claim, EngineMetadata, KVConnectorMetadata, RankMetadata, RankResult,
                                     RecvJob, Release, Reply)
from m3serve.disagg.side_channel import Caller, SideChannelServer

logger = logging.getLogger(__name__)


class WorkerConnector(KVConnectorWorker):
    """One rank's transport (a `core.kv_connector` worker side named "nixl").
    `rank_metadata()` after `register_kv_caches`; per step `start(metadata)` before the forward
    and `poll()` (its `report`) after it."""

    name = "nixl"

    def register_kv_caches(self, planes) -> None:
        raise NotImplementedError

    def rank_metadata(self) -> RankMetadata:
        raise NotImplementedError

    def start(self, metadata: KVConnectorMetadata) -> None:
        raise NotImplementedError

    def poll(self) -> RankResult:
        raise NotImplementedError

    def report(self) -> RankResult:
        return self.poll()


def make_worker_connector(config: KVTransferConfig, tp_rank: int, device) -> WorkerConnector:
    if config.kv_connector == "NixlConnector":
        # a deliberate cycle inside disagg/: the NIXL worker half implements this module's
        # WorkerConnector, and is imported only here, where NIXL is asked for
        from m3serve.disagg.nixl_worker import NixlWorkerConnector
        return NixlWorkerConnector(config, tp_rank, device)
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}")


@dataclass
class _Hold:
    block_ids: list[int]
    prompt_hash: str
    deadline: float


@dataclass
class _Pull:
    params: kvp.KVTransferParams
    job: RecvJob
    num_tokens: int                       # the request's computed tokens once the pull is done
    state: str = "claiming"               # claiming -> queued -> reading -> over
    aborted: bool = False
    failure: str | None = None
    reports: dict[int, str | None] = field(default_factory=dict)   # rank -> failure (None = done)


@dataclass
class KVTransferStats:
    """Counters and gauges of KV transfer; each travels to the API as EngineStats' `kv_<name>`."""
    held_requests: int = 0
    held_blocks: int = 0
    holds_released: int = 0
    holds_expired: int = 0
    pulls_active: int = 0
    pulls_done: int = 0
    pulls_failed: int = 0
    fallbacks: int = 0
    bytes_transferred: int = 0
    num_descriptors: int = 0
    xfer_seconds_sum: float = 0.0
    xfer_count: int = 0


class KVTransferScheduler(KVConnectorScheduler):
    """Owned by the scheduler (engine-loop thread) except `_handle`, which the side-channel
    thread calls; `_lock` guards what they share (the holds). As a KV connector: a decode-leg
    request's pull is a required load of its prompt's KV but the last token."""

    name = "nixl"

    def __init__(self, config: KVTransferConfig, block_size: int, num_blocks: int,
                 ranks: list[RankMetadata]):
        self.config = config
        self.kv_role = config.kv_role
        self.engine_id = config.engine_id
        self.tp_size = len(ranks)
        host, port, env_timeout = envs.nixl_side_channel()
        self.abort_timeout = config.abort_request_timeout or env_timeout
        self.metadata = EngineMetadata(config.engine_id, len(ranks), block_size, num_blocks, ranks)
        self.stats = KVTransferStats()
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._released: list[str] = []
        self.server = None
        self.host, self.port = host, port
        if config.is_producer:
            self.server = SideChannelServer(host, port, self._handle)
            self.port = self.server.port
            logger.info("KV producer %s: side channel on %s:%d", self.engine_id, host, self.port)
        self._caller = Caller(config.handshake_timeout) if config.is_consumer else None
        self._engines: dict[str, EngineMetadata] = {}
        self._new_engines: list[EngineMetadata] = []
        self._pulls: dict[str, _Pull] = {}
        self._to_start: list[RecvJob] = []
        self._over: list[tuple[str, str | None]] = []

    # ------------------------------------------------------------ producer

    def wants_hold(self, request) -> bool:
        p = request.kv_transfer_params
        return self.config.is_producer and p is not None and p.do_remote_decode

    def hold(self, request, block_ids: list[int]) -> dict:
        """Keep a finished request's blocks for its decode worker; the response's params."""
        token_ids = request.prompt_token_ids
        with self._lock:
            self._holds[request.request_id] = _Hold(list(block_ids), kvp.prompt_hash(token_ids),
                                                    time.monotonic() + self.abort_timeout)
        self.stats.held_requests += 1
        self.stats.held_blocks += len(block_ids)
        return kvp.producer_params(block_ids, self.engine_id, request.request_id, self.host, self.port,
                                   self.tp_size, token_ids)

    def _handle(self, message) -> Reply:
        """Side-channel thread."""
        if message.engine_id != self.engine_id:
            return Reply(False, f"this KV producer is engine {self.engine_id!r}, not {message.engine_id!r} "
                                f"(stale kv_transfer_params?)")
        if isinstance(message, Release):
            with self._lock:
                self._released.extend(r for r in message.request_ids if r in self._holds)
            return Reply(True)
        if not isinstance(message, Claim):
            return Reply(False, f"unexpected side-channel message {type(message).__name__}")
        with self._lock:
            hold = self._holds.get(message.request_id)
            if hold is None or message.request_id in self._released:
                return Reply(False, f"request {message.request_id!r} holds no KV here: it was never "
                                    f"prefilled here, was already pulled, or was freed after the "
                                    f"{self.abort_timeout:g} s hold timeout")
            if message.block_ids != hold.block_ids:
                return Reply(False, f"remote_block_ids {message.block_ids[:8]}... are not the blocks "
                                    f"held for request {message.request_id!r}")
            if message.prompt_hash is not None and message.prompt_hash != hold.prompt_hash:
                return Reply(False, f"the prompt differs from the one prefilled for request "
                                    f"{message.request_id!r}")
            hold.deadline = max(hold.deadline, time.monotonic() + self.abort_timeout)
        return Reply(True, metadata=self.metadata if message.want_metadata else None)

    def holds_to_free(self) -> list[str]:
        """Held requests whose KV can go now: released by their consumer, or timed out."""
        now = time.monotonic()
        with self._lock:
            released = list(dict.fromkeys(r for r in self._released if r in self._holds))
            self._released.clear()
            expired = [r for r, h in self._holds.items() if h.deadline < now and r not in released]
            for rid in released + expired:
                self.stats.held_blocks -= len(self._holds.pop(rid).block_ids)
        self.stats.held_requests -= len(released) + len(expired)
        self.stats.holds_released += len(released)
        self.stats.holds_expired += len(expired)
        if expired:
            logger.warning("freed the KV of %d request(s) no decode worker pulled within %g s: %s",
                           len(expired), self.abort_timeout, expired[:4])
        return released + expired

    # ------------------------------------------------------------ consumer

    def wants_pull(self, request) -> bool:
        p = request.kv_transfer_params
        return self.config.is_consumer and p is not None and p.do_remote_prefill

    def begin_pull(self, request, block_ids: list[int], first_block: int, num_tokens: int) -> None:
        """Pull the KV of tokens [first_block * block_size, num_tokens) into `block_ids`
        (the request's whole block list; the leading `first_block` are prefix hits)."""
        p = request.kv_transfer_params
        needed = len(block_ids)
        job = RecvJob(request.request_id, p.remote_engine_id, list(block_ids[first_block:needed]),
                      list(p.remote_block_ids[first_block:needed]))
        pull = _Pull(p, job, num_tokens)
        self._pulls[request.request_id] = pull
        self.stats.pulls_active += 1
        if len(p.remote_block_ids) < needed:
            self._end(request.request_id, f"remote_block_ids lists {len(p.remote_block_ids)} blocks, "
                                          f"but the prompt's KV spans {needed}")
            return
        claim = Claim(p.remote_engine_id, p.remote_request_id, list(p.remote_block_ids), p.prompt_hash,
                      want_metadata=p.remote_engine_id not in self._engines)
        self._caller.submit(request.request_id, p.remote_address, claim)

    def skip_pull(self, request) -> None:
        """The prefix cache already holds the prompt's KV: only tell the producer to free its copy."""
        p = request.kv_transfer_params
        self._caller.submit(("release", request.request_id), p.remote_address,
                            Release(p.remote_engine_id, [p.remote_request_id]))

    def abort_pull(self, request_id: str) -> None:
        """The request was aborted: stop its pull; its end is still reported by `pulls_over`
        (only then may its blocks be freed)."""
        pull = self._pulls.get(request_id)
        if pull is None:
            return
        pull.aborted = True
        if pull.state == "queued":
            self._to_start = [j for j in self._to_start if j.request_id != request_id]
            self._end(request_id, "aborted")

    def _end(self, request_id: str, failure: str | None) -> None:
        pull = self._pulls[request_id]
        if pull.state == "over":
            return
        pull.state, pull.failure = "over", failure
        self._over.append((request_id, failure))
        self.stats.pulls_active -= 1
        if failure is None:
            self.stats.pulls_done += 1
        elif not pull.aborted:
            self.stats.pulls_failed += 1
        p = pull.params
        # the producer frees its copy now, whatever happened here
        self._caller.submit(("release", request_id), p.remote_address,
                            Release(p.remote_engine_id, [p.remote_request_id]))

    def _on_claim(self, request_id: str, result) -> None:
        pull = self._pulls.get(request_id)
        if pull is None or pull.state != "claiming":
            return
        if isinstance(result, str):
            return self._end(request_id, f"the prefill worker did not answer: {result}")
        if not result.ok:
            return self._end(request_id, f"the prefill worker refused: {result.error}")
        engine_id = pull.params.remote_engine_id
        if result.metadata is not None and engine_id not in self._engines:
            try:
                check_compatible(self.metadata.ranks[0].regions, result.metadata.ranks[0].regions,
                                 self.metadata.block_size, result.metadata.block_size)
            except LayoutMismatch as e:
                return self._end(request_id, f"the prefill worker's KV layout does not fit: {e}")
            self._engines[engine_id] = result.metadata
            self._new_engines.append(result.metadata)
        if engine_id not in self._engines:
            return self._end(request_id, f"no metadata of prefill engine {engine_id!r}")
        if pull.aborted:
            return self._end(request_id, "aborted")
        pull.state = "queued"
        self._to_start.append(pull.job)

    def pulls_over(self) -> list[tuple[str, str | None]]:
        """Pulls that ended since the last call: (request id, None = done | why it failed)."""
        if self._caller is not None:
            for key, result in self._caller.results():
                if isinstance(key, tuple):        # a release: best effort
                    if isinstance(result, str) or not result.ok:
                        logger.info("release of %s on its prefill worker: %s", key[1],
                                    result if isinstance(result, str) else result.error)
                    continue
                self._on_claim(key, result)
        over, self._over = self._over, []
        for request_id, _ in over:
            del self._pulls[request_id]
        return over

    def build_metadata(self) -> KVConnectorMetadata | None:
        """The ranks' KV-transfer work for the step being scheduled (None = nothing)."""
        for job in self._to_start:
            self._pulls[job.request_id].state = "reading"
        reading = any(p.state == "reading" for p in self._pulls.values())
        if not (self._new_engines or self._to_start or reading):
            return None
        meta = KVConnectorMetadata(self._new_engines, self._to_start, poll=True)
        self._new_engines, self._to_start = [], []
        return meta

    def update(self, results: list[RankResult]) -> None:
        """Every rank's report of one step (in TP order)."""
        for rank, res in enumerate(results):
            res = as_struct(res, RankResult)
            self.stats.bytes_transferred += res.num_bytes
            self.stats.num_descriptors += res.num_descriptors
            self.stats.xfer_seconds_sum += sum(res.xfer_seconds)
            self.stats.xfer_count += len(res.xfer_seconds)
            for rid in res.done:
                if rid in self._pulls:
                    self._pulls[rid].reports[rank] = None
            for rid, reason in res.failed.items():
                if rid in self._pulls:
                    self._pulls[rid].reports[rank] = f"rank {rank}: {reason}"
        for rid, pull in list(self._pulls.items()):
            if pull.state == "reading" and len(pull.reports) == self.tp_size:
                failures = [r for r in pull.reports.values() if r is not None]
                self._end(rid, "aborted" if pull.aborted else (failures[0] if failures else None))

    # ------------------------------------------------------------ as a KV connector

    def get_num_new_matched_tokens(self, request, num_computed_tokens, hit_blocks, count=True):
        if not self.wants_pull(request):
            return None
        num_kv = request.num_tokens - 1      # the last prompt token is computed here, for logits
        if num_kv <= num_computed_tokens:
            self.skip_pull(request)
            request.kv_transfer_params = None
            return ExternalHit(0)
        return ExternalHit(num_kv - num_computed_tokens, optional=False)

    def start_load(self, request, block_ids, num_computed_tokens):
        request.num_cached_tokens = num_computed_tokens
        self.begin_pull(request, block_ids, num_computed_tokens // self.metadata.block_size,
                        request.num_tokens - 1)

    def take_finished_loads(self):
        return self.pulls_over()

    def on_load_end(self, request, failure):
        request.kv_transfer_params = None
        if failure is None:
            return None
        if self.config.kv_load_failure_policy == "fail":
            return f"pulling the prompt's KV from the prefill worker failed: {failure}"
        self.stats.fallbacks += 1
        logger.warning("request %s: pulling its KV failed (%s); computing its prompt here",
                       request.request_id, failure)
        return None

    def abort(self, request_id):
        self.abort_pull(request_id)

    def request_finished(self, request, block_ids):
        return self.hold(request, block_ids) if self.wants_hold(request) else None

    @property
    def needs_fast_poll(self):
        return self.pulls_in_flight

    # ------------------------------------------------------------ both

    @property
    def has_pending(self) -> bool:
        """Holds or pulls exist: the engine loop must keep calling the scheduler."""
        return bool(self._holds or self._pulls or self._over or (self._caller and self._caller.pending))

    @property
    def pulls_in_flight(self) -> bool:
        """A pull is between its start and its request's admission (claiming, reading, or over
        and waiting to be admitted): every wait here is TTFT, so the engine polls often."""
        return bool(self._pulls or self._over)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._caller is not None:
            self._caller.close()
