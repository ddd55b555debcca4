"""The API process's handle on the engine-core process: start (spawn), submit, abort, stats.

`EngineCoreClient` sends `protocol` messages on a PUSH socket and reads the engine's
`CoreOutputs` on a PULL socket from one asyncio task, routing each sequence's outputs to the
queue of the request that owns it. Anything that speaks the same methods (`info`, `start`,
`add_requests`, `abort`, `get_stats`, `is_healthy`, `shutdown`) can stand in for it in tests.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time

import zmq
import zmq.asyncio

from m3serve import protocol
from m3serve.config import EngineConfig
from m3serve.protocol import EngineCoreRequest, EngineStats

logger = logging.getLogger(__name__)


class EngineOverloaded(Exception):
    """The engine's waiting queue is at its bound; retry later (HTTP 503)."""


class EngineError(RuntimeError):
    """The engine failed a request or is gone (HTTP 500)."""


class EngineCoreClient:
    """Runs the engine core in a spawned process and talks to it over ZMQ (msgpack)."""

    def __init__(self, config: EngineConfig, ready_timeout_s: float = 900.0):
        self.config = config
        self.ready_timeout_s = ready_timeout_s
        self.info: protocol.EngineReady | None = None
        self.stats = EngineStats()
        self.dead_reason: str | None = None
        self._queues: dict[str, asyncio.Queue] = {}        # child request id -> its parent's queue
        self._pending_adds: dict[str, asyncio.Future] = {}
        self._pending_stats: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._proc = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Spawn the engine process and wait until its model is loaded."""
        self._dir = tempfile.mkdtemp(prefix="m3serve-ipc-")
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._sync_context = zmq.Context()
        self._push = self._sync_context.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # unbounded: admission is bounded by the engine instead
        self._push.bind(input_addr)
        self._async_context = zmq.asyncio.Context()
        self._pull = self._async_context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(output_addr)
        from m3serve.core.engine_proc import run_engine_process

        ctx = multiprocessing.get_context("spawn")  # never fork: CUDA and threads do not survive it
        self._proc = ctx.Process(target=run_engine_process, args=(self.config, input_addr, output_addr),
                                 name="m3serve-engine", daemon=True)
        self._proc.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if await self._pull.poll(500):
                message = protocol.decode_output(await self._pull.recv())
                if isinstance(message, protocol.EngineDead):
                    self.shutdown()
                    raise RuntimeError(f"the engine process failed to start: {message.message}")
                if isinstance(message, protocol.EngineReady):
                    self.info = message
                    break
            if not self._proc.is_alive():
                code = self._proc.exitcode
                self.shutdown()
                raise RuntimeError(f"the engine process exited during start-up (exit code {code})")
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the engine was not ready after {self.ready_timeout_s:.0f} s")
        self._task = asyncio.create_task(self._output_loop())

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._proc is not None:
            if self._proc.is_alive():
                try:
                    self._push.send(protocol.encode(protocol.Shutdown()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                self._proc.join(5)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
            self._proc = None
        for sock in (getattr(self, "_push", None), getattr(self, "_pull", None)):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        if getattr(self, "_dir", None):
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._fail_all("the engine is shut down")

    def is_healthy(self) -> bool:
        """True while the engine process is alive and its outputs are being read."""
        return (self.info is not None and self.dead_reason is None and self._proc is not None
                and self._proc.is_alive() and self._task is not None and not self._task.done())

    # ------------------------------------------------------------------ requests

    async def add_requests(self, parent_id: str, requests: list[EngineCoreRequest]) -> asyncio.Queue:
        """Submit the children of one request; returns the queue their `CoreOutput`s arrive on
        (an `EngineError` instance is put there if the engine dies). Raises ValueError (the
        engine rejected the request), EngineOverloaded or EngineError."""
        if not self.is_healthy():
            raise EngineError(self.dead_reason or "the engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        ids = [r.request_id for r in requests]
        for rid in ids:
            self._queues[rid] = queue
        verdict = asyncio.get_running_loop().create_future()
        self._pending_adds[parent_id] = verdict
        try:
            self._send(protocol.AddRequests(parent_id, requests))
            result: protocol.AddResult = await verdict
        except zmq.ZMQError as e:
            self._pending_adds.pop(parent_id, None)
            for rid in ids:
                self._queues.pop(rid, None)
            raise EngineError(f"could not reach the engine: {e}") from None
        except BaseException:
            self._pending_adds.pop(parent_id, None)
            self.abort(ids)
            raise
        if result.kind != "ok":
            for rid in ids:
                self._queues.pop(rid, None)
            if result.kind == "invalid":
                raise ValueError(result.message)
            if result.kind == "overloaded":
                raise EngineOverloaded(result.message)
            raise EngineError(result.message)
        return queue

    def abort(self, request_ids: list[str]) -> None:
        """Abort sequences in the engine (their blocks are freed); never blocks, never raises."""
        live = [rid for rid in request_ids if self._queues.pop(rid, None) is not None]
        if live and self._proc is not None:
            try:
                self._send(protocol.AbortRequests(live))
            except zmq.ZMQError:
                logger.warning("could not send an abort for %s", live)

    async def get_stats(self, timeout_s: float = 5.0) -> EngineStats:
        """Fresh engine stats (answered between two engine steps)."""
        if not self.is_healthy():
            raise EngineError(self.dead_reason or "the engine is not running")
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending_stats[query_id] = future
        self._send(protocol.StatsQuery(query_id))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending_stats.pop(query_id, None)

    # ------------------------------------------------------------------ internals

    def _send(self, message) -> None:
        # A sync PUSH socket: a send only queues, so aborts can go out from `finally` blocks
        # of cancelled tasks without awaiting.
        self._push.send(protocol.encode(message), zmq.NOBLOCK)

    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._pull.poll(1000):
                    if not self._proc.is_alive():
                        self.dead_reason = f"the engine process died (exit code {self._proc.exitcode})"
                        break
                    continue
                message = protocol.decode_output(await self._pull.recv())
                if isinstance(message, protocol.EngineDead):
                    self.dead_reason = f"the engine stopped: {message.message}"
                    break
                if isinstance(message, protocol.CoreOutputs):
                    self._dispatch(message)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("reading engine outputs failed")
            self.dead_reason = f"reading engine outputs failed: {e}"
        logger.error("%s", self.dead_reason)
        self._fail_all(self.dead_reason)

    def _dispatch(self, message: protocol.CoreOutputs) -> None:
        if message.stats is not None:
            self.stats = message.stats
        if message.query_id is not None:
            future = self._pending_stats.pop(message.query_id, None)
            if future is not None and not future.done():
                future.set_result(message.stats)
        for result in message.add_results:
            future = self._pending_adds.pop(result.parent_id, None)
            if future is not None and not future.done():
                future.set_result(result)
        for out in message.outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue  # aborted by the API process already
            if out.finished:
                del self._queues[out.request_id]
            queue.put_nowait(out)

    def _fail_all(self, reason: str) -> None:
        error = EngineError(reason)
        for future in list(self._pending_adds.values()) + list(self._pending_stats.values()):
            if not future.done():
                future.set_exception(error)
        self._pending_adds.clear()
        self._pending_stats.clear()
        for queue in {id(q): q for q in self._queues.values()}.values():
            queue.put_nowait(error)
        self._queues.clear()


def engine_config_for_process(config: EngineConfig, model_dir) -> EngineConfig:
    """The config the engine process gets: the model resolved to a local directory, so that
    both processes read the same checkpoint and nothing is downloaded twice."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, model=os.fspath(model_dir)))

