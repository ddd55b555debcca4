"""The offline `LLM`'s handle on an engine that runs as processes (several ranks, or the `mp`
executor): the same messages as the server's client, as blocking calls with the interface of
an in-process `EngineCore` (`add_requests`, `abort_requests`, `step`,
`has_unfinished_requests`), plus `states()` for checks and `shutdown()`.
"""
from __future__ import annotations

import atexit
import itertools
import time

import zmq

from m3serve import protocol
from m3serve.config import EngineConfig
from m3serve.engine.engine_group import EngineEndpoints, EngineProcesses, ReplicaBook, send_shutdown
from m3serve.engine.errors import EngineDeadError

_POLL_MS = 200


class SyncEngineClient:
    def __init__(self, config: EngineConfig, ready_timeout_s: float = 900.0):
        self.config = config
        self.book = ReplicaBook(config.parallel.data_parallel_size)
        self.endpoints = EngineEndpoints(config)
        self.context = zmq.Context()
        self.pushes = []
        for addr in self.endpoints.bind_inputs:
            push = self.context.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.bind(addr)
            self.pushes.append(push)
        self.pull = self.context.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.bind(self.endpoints.bind_output)
        self.engines = EngineProcesses(config, self.endpoints)
        self.dead_reason: str | None = None
        self._outputs: list[protocol.CoreOutput] = []
        self._results: dict[str, protocol.AddResult] = {}
        self._pending: dict[str, list[str]] = {}       # parent id -> child ids awaiting a verdict
        self._outbox: dict[int, list[protocol.AddRequests]] = {}   # replica -> not yet sent
        self._states: dict[int, dict[int, protocol.EngineState]] = {}
        self._query_ids = itertools.count()
        self.engines.start()
        deadline = time.monotonic() + ready_timeout_s
        try:
            while not self.book.all_ready:
                if self.pull.poll(_POLL_MS):
                    failure = self.book.note_startup(protocol.decode_output(self.pull.recv()))
                    if failure:
                        raise EngineDeadError(f"the engine failed to start: {failure}")
                dead = self.engines.dead_reason()
                if dead is not None:
                    raise EngineDeadError(f"the engine failed to start: {dead}")
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"the engine was not ready after {ready_timeout_s:.0f} s")
        except BaseException:
            self.shutdown()
            raise
        self.info = self.book.info()
        atexit.register(self.shutdown)     # before multiprocessing joins its children at exit

    # ------------------------------------------------------------ requests

    def add_requests(self, requests: list[protocol.EngineCoreRequest]) -> None:
        """Place the children of one request on the least loaded replica, admitted all or
        none. They are sent by `settle`, with every other request placed since, as one message
        per replica: the replica admits the whole batch before its next step, as an in-process
        engine would."""
        parent_id = requests[0].request_id
        replica = self.book.choose()
        ids = [r.request_id for r in requests]
        self.book.place(replica, ids)
        self._pending[parent_id] = ids
        self._outbox.setdefault(replica, []).append(protocol.AddRequests(parent_id, requests))

    def settle(self) -> None:
        """Send the placed requests and wait for their verdicts; ValueError naming the first
        refused one (the refused hold nothing in the engine)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        for replica, messages in self._outbox.items():
            self.pushes[replica].send_multipart([protocol.encode(m) for m in messages], zmq.NOBLOCK)
        self._outbox.clear()
        while any(parent not in self._results for parent in self._pending):
            self._receive()
        refused = []
        for parent, ids in self._pending.items():
            result = self._results.pop(parent)
            if result.kind != "ok":
                for rid in ids:
                    self.book.release(rid)
                refused.append(result)
        self._pending.clear()
        if refused:
            first = refused[0]
            if first.kind == "invalid":
                raise ValueError(first.message)
            raise RuntimeError(f"the engine refused request {first.parent_id}: {first.message}")

    def abort_requests(self, request_ids) -> None:
        self.settle()
        for replica, ids in self.book.by_replica(request_ids).items():
            for rid in ids:
                self.book.release(rid)
            self._send(replica, protocol.AbortRequests(ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.book.owner)

    def step(self) -> list[protocol.CoreOutput]:
        """The outputs that arrived since the last call, waiting for at least one while any
        request is unfinished."""
        self.settle()
        while not self._outputs and self.book.owner:
            self._receive()
        outputs, self._outputs = self._outputs, []
        for out in outputs:
            if out.finished:
                self.book.release(out.request_id)
        return outputs

    def states(self, timeout_s: float = 60.0) -> list[protocol.EngineState]:
        """Every replica's `EngineState`, in replica order."""
        self.settle()
        query_id = next(self._query_ids)
        self._states[query_id] = {}
        for replica in range(self.book.dp_size):
            self._send(replica, protocol.StateQuery(query_id))
        deadline = time.monotonic() + timeout_s
        while len(self._states[query_id]) < self.book.dp_size:
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the engine did not report its state within {timeout_s:.0f} s")
            self._receive()
        answers = self._states.pop(query_id)
        return [answers[d] for d in sorted(answers)]

    # ------------------------------------------------------------ internals

    def _send(self, replica: int, message) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self.pushes[replica].send(protocol.encode(message), zmq.NOBLOCK)

    def _receive(self) -> None:
        """Wait for one message (raising EngineDeadError if the engine is gone) and file it."""
        if self.engines is None:
            raise EngineDeadError(self.dead_reason or "the engine is shut down")
        while not self.pull.poll(_POLL_MS):
            dead = self.engines.dead_reason()
            if dead is not None:
                self._die(dead)
        message = protocol.decode_output(self.pull.recv())
        if isinstance(message, protocol.EngineDead):
            self._die(f"engine replica {message.dp_rank} stopped: {message.message}")
        if isinstance(message, protocol.CoreOutputs):
            for result in message.add_results:
                self._results[result.parent_id] = result
            self._outputs.extend(message.outputs)
        elif isinstance(message, protocol.EngineState):
            answers = self._states.get(message.query_id)
            if answers is not None:
                answers[message.dp_rank] = message

    def _die(self, reason: str):
        self.dead_reason = reason
        self.shutdown()
        raise EngineDeadError(reason)

    def shutdown(self) -> None:
        atexit.unregister(self.shutdown)
        if self.engines is None:
            return
        send_shutdown(self.pushes)
        self.engines.stop()
        self.engines = None
        for sock in [*self.pushes, self.pull]:
            sock.close(linger=0)
        self.context.term()
        self.endpoints.cleanup()
