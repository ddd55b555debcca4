"""The engine process of one DP replica: its executor (this process is the replica's leader
rank) + `EngineCore`, stepped in a busy loop behind ZMQ sockets to the API process (or the
offline `LLM`).

`EngineLoop` applies `protocol` inputs to an `EngineCore` and turns its outputs into
`CoreOutput`s; it holds the admission bound (`max_waiting_requests`) and contains failures: a
request that cannot be added, or a step that raises for one request, fails only the requests
involved. A failure of the ranks themselves (`ExecutorFailure`, a dead or stuck rank) is fatal:
the engine reports `EngineDead` naming the rank and exits. With several DP replicas the loop
steps every iteration, work or not, because the replicas' MoE layers run in lock step.
`run_engine_process` is the spawn target.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import traceback

import msgspec
import zmq

from m3serve import envs, memtrace
from m3serve import protocol
from m3serve.config import EngineConfig
from m3serve.engine.engine_core import EngineCore
from m3serve.protocol import AddResult, CoreOutput, CoreOutputs, EngineStats

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100    # wait for input this long when there is nothing to step
_LOCKSTEP_IDLE_POLL_MS = 10   # ... when idle replicas must still meet the others
_KV_PULL_POLL_MS = 1   # ... when a pull is under way (claim, read, admission: it is all TTFT)
_KV_HOLD_POLL_MS = 20  # ... when KV is held for, or claimed from, another worker
_GRAMMAR_POLL_MS = 2   # ... when requests wait for their grammars (compiled on other threads)


class EngineLoop:
    """Applies API messages to an engine core and steps it; never raises for one request."""

    def __init__(self, core: EngineCore, dp_rank: int = 0):
        self.core = core
        self.dp_rank = dp_rank
        self.max_waiting = core.config.scheduler.max_waiting_requests
        self.num_step_errors = 0

    def add(self, message: protocol.AddRequests) -> AddResult:
        scheduler = self.core.scheduler
        if scheduler.num_waiting + len(message.requests) > self.max_waiting:
            return AddResult(message.parent_id, "overloaded",
                             f"the waiting queue holds {scheduler.num_waiting} requests; its bound "
                             f"(--max-waiting-requests) is {self.max_waiting}")
        try:
            self.core.add_requests(message.requests)
        except ValueError as e:
            return AddResult(message.parent_id, "invalid", str(e))
        except Exception as e:  # an engine bug must fail this request, not the process
            logger.exception("adding request %s failed", message.parent_id)
            return AddResult(message.parent_id, "error", f"{type(e).__name__}: {e}")
        return AddResult(message.parent_id, "ok")

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def idle_poll_ms(self, lockstep: bool) -> int:
        """How long to wait for input before the next step when no request can run now."""
        scheduler = self.core.scheduler
        if scheduler.num_running or scheduler.waiting or scheduler.has_finished_requests():
            return 0
        if scheduler.has_grammar_work:
            return _GRAMMAR_POLL_MS
        if scheduler.has_kv_transfer_work:     # a load or copy under way is TTFT; a hold is not
            return _KV_PULL_POLL_MS if scheduler.kv_transfer_is_urgent else _KV_HOLD_POLL_MS
        return _LOCKSTEP_IDLE_POLL_MS if lockstep else _IDLE_POLL_MS

    def step(self) -> list[CoreOutput]:
        """One engine step. If the model or the scheduler update raises, the requests scheduled
        in that step are aborted (their blocks freed) and reported with finish_reason "error".
        `ExecutorFailure` (the ranks are gone) propagates."""
        from m3serve.executor import ExecutorFailure, ReplicasStopping

        scheduler = self.core.scheduler
        scheduler_output = scheduler.schedule()
        try:
            outputs = self.core.execute(scheduler_output, skip_idle=not self.core.executor.needs_lockstep)
        except (ExecutorFailure, ReplicasStopping):
            raise
        except Exception as e:
            self.num_step_errors += 1
            failed = list(dict.fromkeys(self.core.abandon_deferred() + list(scheduler_output.num_scheduled_tokens)))
            logger.error("engine step failed for requests %s:\n%s", failed, traceback.format_exc())
            scheduler.abort_requests(failed)
            scheduler.encoder_cache.drop_unheld()
            message = f"engine step failed: {type(e).__name__}: {e}"
            return [CoreOutput(rid, [], finish_reason="error", error=message) for rid in failed]
        finally:
            self.core.num_steps += 1
        return outputs

    def stats(self) -> EngineStats:
        scheduler, kv = self.core.scheduler, self.core.kv_manager
        spec = scheduler.spec_stats
        return EngineStats(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            kv_cache_usage=kv.usage, num_free_blocks=kv.num_free_blocks,
            num_usable_blocks=kv.num_usable_blocks, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_preemptions=scheduler.num_preemptions,
            num_steps=self.core.num_steps, num_step_errors=self.num_step_errors,
            iteration_token_counts=list(self.core.iteration_token_counts),
            iteration_tokens_sum=self.core.iteration_tokens_sum,
            spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
            spec_synthetic_acceptance=self.core.config.speculative.rejection_sample_method == "synthetic"
            and self.core.config.speculative.enabled, **self._kv_stats(), **self._offload_stats(),
            **self._encoder_cache_stats())

    def _encoder_cache_stats(self) -> dict:
        book = self.core.scheduler.encoder_cache
        return dict(mm_encoder_cache_queries=book.stats.queries, mm_encoder_cache_hits=book.stats.hits,
                    mm_encoder_cache_evictions=book.stats.evictions, mm_encoder_cache_bytes=book.num_bytes)

    def _offload_stats(self) -> dict:
        offload = self.core.kv_manager.offload
        if offload is None:
            return {}
        s, tier, unit = offload.stats, offload.tier, self.core.geometry.cpu_block_bytes
        return dict(external_prefix_cache_queries=s.queries, external_prefix_cache_hits=s.hits,
                    kv_offload_bytes_to_cpu=s.blocks_to_cpu * unit, kv_offload_bytes_to_gpu=s.blocks_to_gpu * unit,
                    kv_offload_seconds_to_cpu=s.seconds_to_cpu, kv_offload_seconds_to_gpu=s.seconds_to_gpu,
                    kv_offload_evictions=tier.num_evictions, kv_offload_usage=tier.usage,
                    kv_offload_num_slots=tier.num_slots)

    def _kv_stats(self) -> dict:
        connector = self.core.scheduler.connector
        connector = connector.find("nixl") if connector is not None else None
        if connector is None:
            return {}
        return {"kv_" + name: value for name, value in dataclasses.asdict(connector.stats).items()}

    def state(self, query_id: int) -> protocol.EngineState:
        return self.core.state(query_id, self.dp_rank)


def _serve(loop: EngineLoop, pull: zmq.Socket, push: zmq.Socket) -> None:
    from m3serve.executor import ReplicasStopping

    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    executor = loop.core.executor
    lockstep = executor.needs_lockstep
    while True:
        timeout = (0 if lockstep and (executor.global_busy or executor.stop_requested)
                   else loop.idle_poll_ms(lockstep))
        poller.poll(timeout)
        add_results, state_queries = [], []
        while True:
            try:     # a multipart message (a batch of admissions) arrives whole
                parts = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            for message in (_decode_or_refuse(part, add_results) for part in parts):
                if isinstance(message, protocol.Shutdown):
                    if not lockstep:
                        return
                    executor.request_stop()   # leave with the other replicas, at the next step
                if isinstance(message, protocol.AddRequests):
                    add_results.append(loop.add(message))
                elif isinstance(message, protocol.AbortRequests):
                    loop.abort(message.request_ids)
                elif isinstance(message, protocol.StatsQuery):
                    push.send(protocol.encode(CoreOutputs(stats=loop.stats(), query_id=message.query_id,
                                                          dp_rank=loop.dp_rank)))
                elif isinstance(message, protocol.StateQuery):
                    state_queries.append(message.query_id)
        try:
            outputs = loop.step() if (lockstep or loop.has_work()) else []
        except ReplicasStopping:     # lock step: every replica got here in the same step
            return
        if outputs or add_results:
            push.send(protocol.encode(CoreOutputs(outputs, add_results, loop.stats(),
                                                  dp_rank=loop.dp_rank)))
        for query_id in state_queries:     # after the step: finished requests are flushed
            push.send(protocol.encode(loop.state(query_id)))


def _decode_or_refuse(data: bytes, add_results: list[AddResult]):
    """One message from the API process, or None when it does not decode. The API process
    validates every request, so that is an m3serve bug; an admission that fails this way is
    refused on its own (an "error" result, a 500 for that request), and the engine keeps serving."""
    try:
        return protocol.decode_input(data)
    except msgspec.DecodeError as e:
        try:
            raw = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            raw = None
        parent = raw.get("parent_id") if isinstance(raw, dict) and raw.get("type") == "add" else None
        logger.error("dropped a message from the API process that does not decode (%s): %s",
                     f"admission {parent!r}" if isinstance(parent, str) else "not an admission", e)
        if isinstance(parent, str):
            add_results.append(AddResult(parent, "error", f"the engine could not decode the request: {e}"))
        return None


def _report_fatal(output_addr: str, dp_rank: int, message: str) -> None:
    """From any thread: tell the API process on a socket of our own, then exit at once (the
    main thread may be blocked in a collective that will never return)."""
    logger.error("engine replica %d failed: %s", dp_rank, message)
    try:
        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.connect(output_addr)
        sock.send(protocol.encode(protocol.EngineDead(message, dp_rank=dp_rank)))
        sock.close(linger=2000)
        context.term()                            # waits (up to the linger) until it is sent
    finally:
        os._exit(1)


def make_executor(config: EngineConfig, model_dir, dp_rank: int, master_port: int | None,
                  on_fatal, progress: bool = False):
    """The uni-process executor for one rank (unless `mp` is asked for), else this process
    becomes DP replica `dp_rank`'s leader rank."""
    if not config.parallel.uses_processes:
        from m3serve.executor.uniproc import UniProcExecutor
        return UniProcExecutor(config, model_dir, progress=progress)
    from m3serve.executor.multiproc import MultiprocExecutor
    rank = dp_rank * config.parallel.tensor_parallel_size
    return MultiprocExecutor(config, model_dir, rank, master_port, on_fatal, progress=progress)


def run_engine_process(config: EngineConfig, input_addr: str, output_addr: str, dp_rank: int = 0,
                       master_port: int | None = None) -> None:
    """Spawn target: build the executor and core, announce `EngineReady`, serve until
    `Shutdown`, a fatal failure, or the end of the process that started it."""
    logging.basicConfig(level=envs.log_level(), format=f"%(levelname)s engine{dp_rank} %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle
    memtrace.start(envs.debug_tracemalloc_frames())
    from m3serve.executor.supervisor import start_heartbeat
    start_heartbeat()                             # exits with the process that started us
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.connect(input_addr)
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow API process
    push.connect(output_addr)

    def on_fatal(message: str) -> None:
        _report_fatal(output_addr, dp_rank, message)

    executor = None
    try:
        from m3serve.model.files import model_directory

        executor = make_executor(config, model_directory(config.model.model), dp_rank, master_port, on_fatal)
        core = EngineCore(config, executor)
    except Exception as e:
        # one line (the API process repeats it); the traceback with --log-level debug
        logger.error("engine start-up failed: %s: %s", type(e).__name__, e)
        logger.debug("engine start-up failure", exc_info=True)
        push.send(protocol.encode(protocol.EngineDead(f"{type(e).__name__}: {e}", dp_rank=dp_rank)))
        push.close(linger=2000)
        context.term()
        if executor is not None:
            executor.shutdown()
        os._exit(1)
    model_config = core.geometry.model_config
    push.send(protocol.encode(protocol.EngineReady(
        max_model_len=core.max_model_len, block_size=core.geometry.block_size,
        num_usable_blocks=core.kv_manager.num_usable_blocks, vocab_size=model_config.vocab_size,
        eos_token_id=model_config.eos_token_id, dp_rank=dp_rank,
        world_size=config.parallel.world_size, max_waiting_requests=config.scheduler.max_waiting_requests,
        media_refusal=core.media_refusal())))
    code = 0
    try:
        _serve(EngineLoop(core, dp_rank), pull, push)
    except Exception as e:
        logger.exception("engine loop failed")
        push.send(protocol.encode(protocol.EngineDead(f"{type(e).__name__}: {e}", dp_rank=dp_rank)))
        code = 1
    finally:
        pull.close(linger=0)
        push.close(linger=1000)
        context.term()
        core.shutdown()
        executor.shutdown()
    os._exit(code)
