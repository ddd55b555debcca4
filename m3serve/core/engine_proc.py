"""The engine-core process: Worker + EngineCore stepped in a busy loop behind two ZMQ sockets.

`EngineLoop` applies `protocol` inputs to an `EngineCore` and turns its outputs into
`CoreOutput`s; it holds the admission bound (`max_waiting_requests`) and contains failures: a
request that cannot be added, or a step that raises, fails only the requests involved.
`run_engine_process` is the spawn target that loads the model and runs the loop.
"""
from __future__ import annotations

import logging
import multiprocessing
import signal
import time
import traceback

import zmq

from m3serve import protocol
from m3serve.config import EngineConfig
from m3serve.core.engine_core import EngineCore
from m3serve.core.request import Request
from m3serve.protocol import AddResult, CoreOutput, CoreOutputs, EngineStats

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100  # wait for input this long when there is nothing to step
_PARENT_CHECK_S = 1.0


class EngineLoop:
    """Applies API messages to an engine core and steps it; never raises for one request."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.max_waiting = core.config.scheduler.max_waiting_requests
        self.num_step_errors = 0

    def add(self, message: protocol.AddRequests) -> AddResult:
        scheduler = self.core.scheduler
        if scheduler.num_waiting + len(message.requests) > self.max_waiting:
            return AddResult(message.parent_id, "overloaded",
                             f"the waiting queue holds {scheduler.num_waiting} requests; its bound "
                             f"(--max-waiting-requests) is {self.max_waiting}")
        added = []
        try:
            for r in message.requests:
                self.core.add_request(Request(r.request_id, r.prompt_token_ids, r.sampling_params,
                                              r.eos_token_id, arrival_time=r.arrival_time,
                                              cache_salt=r.cache_salt))
                added.append(r.request_id)
        except ValueError as e:
            self.core.abort_requests(added)
            return AddResult(message.parent_id, "invalid", str(e))
        except Exception as e:  # an engine bug must fail this request, not the process
            logger.exception("adding request %s failed", message.parent_id)
            self.core.abort_requests(added)
            return AddResult(message.parent_id, "error", f"{type(e).__name__}: {e}")
        return AddResult(message.parent_id, "ok")

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[CoreOutput]:
        """One engine step. If the model or the scheduler update raises, the requests scheduled
        in that step are aborted (their blocks freed) and reported with finish_reason "error"."""
        scheduler = self.core.scheduler
        scheduler_output = scheduler.schedule()
        try:
            runner_output = self.core.executor.execute_model(scheduler_output)
            outputs = scheduler.update_from_output(scheduler_output, runner_output)
        except Exception as e:
            self.num_step_errors += 1
            failed = list(scheduler_output.num_scheduled_tokens)
            logger.error("engine step failed for requests %s:\n%s", failed, traceback.format_exc())
            scheduler.abort_requests(failed)
            message = f"engine step failed: {type(e).__name__}: {e}"
            return [CoreOutput(rid, [], finish_reason="error", error=message) for rid in failed]
        finally:
            self.core.num_steps += 1
        return [CoreOutput(o.request_id, list(o.new_token_ids), o.finish_reason, o.stop_reason,
                           o.new_logprobs, o.new_prompt_logprobs, o.num_cached_tokens)
                for o in outputs]

    def stats(self) -> EngineStats:
        scheduler, kv = self.core.scheduler, self.core.kv_manager
        return EngineStats(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            kv_cache_usage=kv.usage, num_free_blocks=kv.num_free_blocks,
            num_usable_blocks=kv.num_usable_blocks, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_preemptions=scheduler.num_preemptions,
            num_steps=self.core.num_steps, num_step_errors=self.num_step_errors)


def _serve(loop: EngineLoop, pull: zmq.Socket, push: zmq.Socket) -> None:
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    parent = multiprocessing.parent_process()
    last_parent_check = time.monotonic()
    while True:
        poller.poll(0 if loop.has_work() else _IDLE_POLL_MS)
        add_results = []
        while True:
            try:
                message = protocol.decode_input(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if isinstance(message, protocol.Shutdown):
                return
            if isinstance(message, protocol.AddRequests):
                add_results.append(loop.add(message))
            elif isinstance(message, protocol.AbortRequests):
                loop.abort(message.request_ids)
            elif isinstance(message, protocol.StatsQuery):
                push.send(protocol.encode(CoreOutputs(stats=loop.stats(), query_id=message.query_id)))
        outputs = loop.step() if loop.has_work() else []
        if outputs or add_results:
            push.send(protocol.encode(CoreOutputs(outputs, add_results, loop.stats())))
        now = time.monotonic()
        if parent is not None and now - last_parent_check > _PARENT_CHECK_S:
            last_parent_check = now
            if not parent.is_alive():
                logger.warning("the API process is gone; engine exits")
                return


def run_engine_process(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Spawn target: load the model, announce `EngineReady`, serve until `Shutdown`."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s engine %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.connect(input_addr)
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow API process
    push.connect(output_addr)
    try:
        from m3serve.llm import model_directory
        from m3serve.worker.worker import Worker

        worker = Worker(config, model_directory(config.model.model), progress=False)
        core = EngineCore(config, worker)
    except Exception as e:
        logger.exception("engine start-up failed")
        push.send(protocol.encode(protocol.EngineDead(f"{type(e).__name__}: {e}")))
        push.close(linger=2000)
        context.term()
        return
    model_config = worker.model_config
    push.send(protocol.encode(protocol.EngineReady(
        max_model_len=core.max_model_len, block_size=worker.block_size,
        num_usable_blocks=core.kv_manager.num_usable_blocks, vocab_size=model_config.vocab_size,
        eos_token_id=model_config.eos_token_id)))
    try:
        _serve(EngineLoop(core), pull, push)
    except Exception as e:
        logger.exception("engine loop failed")
        push.send(protocol.encode(protocol.EngineDead(f"{type(e).__name__}: {e}")))
    finally:
        pull.close(linger=0)
        push.close(linger=1000)
        context.term()
