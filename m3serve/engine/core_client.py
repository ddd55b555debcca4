"""The API process's handle on the engine: start its processes (spawn), submit, abort, stats.

`EngineCoreClient` sends `protocol` messages on one PUSH socket per DP replica and reads every
replica's messages on one PULL socket from an asyncio task, routing each sequence's outputs to
the queue of the request that owns it. A request goes to the least loaded replica. Anything
that speaks the same methods (`info`, `start`, `add_requests`, `abort`, `get_stats`,
`is_healthy`, `shutdown`) can stand in for it in tests.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time

import zmq
import zmq.asyncio

from m3serve import protocol
from m3serve.config import EngineConfig
from m3serve.engine.engine_group import EngineEndpoints, EngineProcesses, ReplicaBook, send_shutdown
from m3serve.engine.errors import EngineDeadError, EngineError, EngineOverloaded, ShuttingDown
from m3serve.protocol import EngineCoreRequest, EngineStats

logger = logging.getLogger(__name__)


class EngineCoreClient:
    """Runs the engine in spawned processes and talks to them over ZMQ (msgpack)."""

    def __init__(self, config: EngineConfig, ready_timeout_s: float = 900.0):
        self.config = config
        self.ready_timeout_s = ready_timeout_s
        self.info: protocol.EngineReady | None = None
        self.stats = EngineStats()
        self.dead_reason: str | None = None
        self.book = ReplicaBook(config.parallel.data_parallel_size)
        self._queues: dict[str, asyncio.Queue] = {}        # child request id -> its parent's queue
        self._pending_adds: dict[str, asyncio.Future] = {}
        self._outbox: dict[int, list[protocol.AddRequests]] = {}   # replica -> admissions to send
        # query id -> (future, answers so far by replica)
        self._pending_stats: dict[int, tuple[asyncio.Future, dict[int, EngineStats]]] = {}
        self._pending_states: dict[int, tuple[asyncio.Future, dict[int, protocol.EngineState]]] = {}
        self._query_ids = itertools.count()
        self._engines: EngineProcesses | None = None
        self._pushes: list[zmq.Socket] = []
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Start the engine processes and wait until every replica's model is loaded."""
        self._endpoints = endpoints = EngineEndpoints(self.config)
        self._sync_context = zmq.Context()
        for addr in endpoints.bind_inputs:
            push = self._sync_context.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)  # unbounded: admission is bounded by the engine instead
            push.bind(addr)
            self._pushes.append(push)
        self._async_context = zmq.asyncio.Context()
        self._pull = self._async_context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(endpoints.bind_output)
        self._engines = EngineProcesses(self.config, endpoints)
        self._engines.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not self.book.all_ready:
            if await self._pull.poll(500):
                failure = self.book.note_startup(protocol.decode_output(await self._pull.recv()))
                if failure:
                    self.shutdown()
                    raise RuntimeError(f"the engine failed to start: {failure}")
            dead = self._engines.dead_reason()
            if dead is not None:
                self.shutdown()
                raise RuntimeError(f"the engine failed to start: {dead}")
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the engine was not ready after {self.ready_timeout_s:.0f} s")
        self.info = self.book.info()
        self._task = asyncio.create_task(self._output_loop())

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._engines is not None:
            send_shutdown(self._pushes)
            self._engines.stop()
            self._engines = None
        for sock in [*self._pushes, getattr(self, "_pull", None)]:
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        if getattr(self, "_endpoints", None) is not None:
            self._endpoints.cleanup()
        self.dead_reason = self.dead_reason or "the engine is shut down"
        self._fail_all(self.dead_reason)

    def is_healthy(self) -> bool:
        """True while every engine process is alive and their outputs are being read."""
        return (self.info is not None and self.dead_reason is None and self._engines is not None
                and self._engines.dead_reason() is None and self._task is not None
                and not self._task.done())

    def _check_healthy(self) -> None:
        if not self.is_healthy():
            raise EngineDeadError(f"the engine is not running: {self.dead_reason or 'not started'}")

    # ------------------------------------------------------------------ requests

    async def add_requests(self, parent_id: str, requests: list[EngineCoreRequest]) -> asyncio.Queue:
        """Submit the children of one request to one replica; returns the queue their
        `CoreOutput`s arrive on (an `EngineError` instance is put there if the engine dies).
        Raises ValueError (the engine rejected the request), EngineOverloaded or EngineError."""
        self._check_healthy()
        queue: asyncio.Queue = asyncio.Queue()
        ids = [r.request_id for r in requests]
        replica = self.book.choose()
        self.book.place(replica, ids)
        for rid in ids:
            self._queues[rid] = queue
        verdict = asyncio.get_running_loop().create_future()
        self._pending_adds[parent_id] = verdict
        try:
            self._queue_add(replica, protocol.AddRequests(parent_id, requests))
            result: protocol.AddResult = await verdict
        except EngineError:
            self._pending_adds.pop(parent_id, None)
            self._forget(ids)
            raise
        except BaseException:
            self._pending_adds.pop(parent_id, None)
            self.abort(ids)
            raise
        if result.kind != "ok":
            self._forget(ids)
            if result.kind == "invalid":
                raise ValueError(result.message)
            if result.kind == "overloaded":
                raise EngineOverloaded(result.message)
            raise EngineError(result.message)
        return queue

    def _forget(self, request_ids) -> None:
        for rid in request_ids:
            self._queues.pop(rid, None)
            self.book.release(rid)

    def abort(self, request_ids: list[str]) -> None:
        """Abort sequences in the engine (their blocks are freed); never blocks, never raises."""
        live = [rid for rid in request_ids if self._queues.pop(rid, None) is not None]
        for replica, ids in self.book.by_replica(live).items():
            for rid in ids:
                self.book.release(rid)
            if self._engines is not None:
                try:
                    self._send(replica, protocol.AbortRequests(ids))
                except zmq.ZMQError:
                    logger.warning("could not send an abort for %s", ids)

    async def get_stats(self, timeout_s: float = 5.0) -> EngineStats:
        """Fresh engine stats (each replica answers between two of its steps), combined."""
        answers = await self._query(self._pending_stats, protocol.StatsQuery, timeout_s)
        return ReplicaBook.combine([answers[d] for d in sorted(answers)])

    async def get_state(self, timeout_s: float = 30.0) -> list[protocol.EngineState]:
        """Every replica's `EngineState` (after its next step), in replica order."""
        answers = await self._query(self._pending_states, protocol.StateQuery, timeout_s)
        return [answers[d] for d in sorted(answers)]

    async def _query(self, pending: dict, message_type, timeout_s: float) -> dict:
        self._check_healthy()
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        pending[query_id] = (future, {})
        for replica in range(self.book.dp_size):
            self._send(replica, message_type(query_id))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            pending.pop(query_id, None)

    # ------------------------------------------------------------------ internals

    def _queue_add(self, replica: int, message: protocol.AddRequests) -> None:
        """Admissions made in one turn of the event loop (the prompts of one request, or
        requests arriving together) leave as one multipart message per replica, which the
        engine admits before its next step."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush_adds)
        self._outbox.setdefault(replica, []).append(message)

    def _flush_adds(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for replica, messages in outbox.items():
            try:
                self._pushes[replica].send_multipart([protocol.encode(m) for m in messages], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                for m in messages:
                    future = self._pending_adds.pop(m.parent_id, None)
                    if future is not None and not future.done():
                        future.set_exception(EngineError(f"could not reach the engine: {e}"))

    def _send(self, replica: int, message) -> None:
        # A sync PUSH socket: a send only queues, so aborts can go out from `finally` blocks
        # of cancelled tasks without awaiting. Queued admissions go first, so that an abort
        # never overtakes the admission it cancels.
        if self._outbox:
            self._flush_adds()
        self._pushes[replica].send(protocol.encode(message), zmq.NOBLOCK)

    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._pull.poll(1000):
                    dead = self._engines.dead_reason()
                    if dead is not None:
                        self.dead_reason = dead
                        break
                    continue
                message = protocol.decode_output(await self._pull.recv())
                if isinstance(message, protocol.EngineDead):
                    self.dead_reason = f"engine replica {message.dp_rank} stopped: {message.message}"
                    break
                if isinstance(message, protocol.CoreOutputs):
                    self._dispatch(message)
                elif isinstance(message, protocol.EngineState):
                    self._answer(self._pending_states, message.query_id, message.dp_rank, message)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("reading engine outputs failed")
            self.dead_reason = f"reading engine outputs failed: {e}"
        logger.error("%s", self.dead_reason)
        self._fail_all(self.dead_reason)
        if self._engines is not None:       # replicas in lock step cannot go on without it
            send_shutdown(self._pushes)
            await asyncio.to_thread(self._engines.stop, 2.0)

    def _answer(self, pending: dict, query_id: int, replica: int, answer) -> None:
        entry = pending.get(query_id)
        if entry is None:
            return
        future, answers = entry
        answers[replica] = answer
        if len(answers) == self.book.dp_size and not future.done():
            future.set_result(answers)

    def _dispatch(self, message: protocol.CoreOutputs) -> None:
        if message.stats is not None:
            self.book.stats_by_replica[message.dp_rank] = message.stats
            self.stats = ReplicaBook.combine(list(self.book.stats_by_replica.values()))
        if message.query_id is not None:
            self._answer(self._pending_stats, message.query_id, message.dp_rank, message.stats)
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
                self.book.release(out.request_id)
            queue.put_nowait(out)

    def abort_all(self, reason: str) -> int:
        """Abort every live request in the engine (their blocks are freed) and end each with
        `ShuttingDown(reason)`; returns how many sequences were aborted."""
        live = list(self._queues)
        queues = {id(q): q for q in self._queues.values()}.values()
        self.abort(live)
        for queue in queues:
            queue.put_nowait(ShuttingDown(reason))
        return len(live)

    def _fail_all(self, reason: str) -> None:
        error = EngineDeadError(f"the engine is not running: {reason}")
        futures = list(self._pending_adds.values()) + [f for f, _ in self._pending_stats.values()]
        futures += [f for f, _ in self._pending_states.values()]
        for future in futures:
            if not future.done():
                future.set_exception(error)
        self._pending_adds.clear()
        self._pending_stats.clear()
        self._pending_states.clear()
        for queue in {id(q): q for q in self._queues.values()}.values():
            queue.put_nowait(error)
        self._queues.clear()


def engine_config_for_process(config: EngineConfig, model_dir) -> EngineConfig:
    """The config the engine processes get: the model resolved to a local directory, so that
    every process reads the same checkpoint and nothing is downloaded twice."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, model=os.fspath(model_dir)))
