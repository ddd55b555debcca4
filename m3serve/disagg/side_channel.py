"""The producer's side channel (a ZMQ ROUTER served from a thread of its engine process) and
the ways to call it: `call` (blocking, for a thread), `call_async` (the API process) and
`Caller` (a background thread the scheduler hands calls to, collecting the answers).

Messages are `messages.Claim` / `Release`, answered by `messages.Reply`. A caller that gets no
answer within its timeout raises `SideChannelError` (the producer is gone or unreachable).
"""
from __future__ import annotations

import logging
import queue
import socket
import threading

import msgspec
import zmq
import zmq.asyncio

from m3serve.disagg import messages
from m3serve.disagg.messages import Reply

logger = logging.getLogger(__name__)


class SideChannelError(RuntimeError):
    """No answer from the producer's side channel."""


def _bind_address(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"VLLM_NIXL_SIDE_CHANNEL_HOST {host!r} does not resolve: {e}") from None


class SideChannelServer:
    """Answers each message with `handler(message) -> Reply` on its own thread. `handler` must
    be thread-safe with respect to the engine loop."""

    def __init__(self, host: str, port: int | None, handler):
        self.host, self.handler = host, handler
        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{_bind_address(host)}"
        try:
            if port is None:
                self.port = self._sock.bind_to_random_port(address)
            else:
                self._sock.bind(f"{address}:{port}")
                self.port = port
        except zmq.ZMQError as e:
            self._sock.close()
            self._context.term()
            raise ValueError(f"cannot open the KV side channel on {host}:{port}: {e} (set "
                             f"VLLM_NIXL_SIDE_CHANNEL_PORT to a free port, or leave it unset)") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="m3serve-kv-side-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) < 2:
                continue
            ident, data = frames[0], frames[-1]
            try:
                message = messages.decode_side(data)
                reply = self.handler(message) if not isinstance(message, Reply) else \
                    Reply(False, "a reply is not a request")
            except Exception as e:   # a malformed or hostile message must not stop the channel
                logger.warning("KV side channel: bad message: %s", e)
                reply = Reply(False, f"malformed side-channel message: {type(e).__name__}: {e}")
            self._sock.send_multipart([ident, b"", messages.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._sock.close(linger=0)
        self._context.term()


_context = None


def _sync_context() -> zmq.Context:
    global _context
    if _context is None:
        _context = zmq.Context.instance()
    return _context


def _no_answer(address: str, timeout_s: float) -> SideChannelError:
    return SideChannelError(f"no answer from the KV side channel at {address} within {timeout_s:g} s")


def _reply(address: str, data: bytes) -> Reply:
    try:
        reply = messages.decode_side(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SideChannelError(f"KV side channel at {address} sent a malformed reply: {e}") from None
    if not isinstance(reply, Reply):
        raise SideChannelError(f"KV side channel at {address} answered with {type(reply).__name__}")
    return reply


def call(address: str, message, timeout_s: float) -> Reply:
    """Send one message to a side channel and wait for its reply (any thread)."""
    sock = _sync_context().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(messages.encode(message))
        if not sock.poll(int(timeout_s * 1000)):
            raise _no_answer(address, timeout_s)
        return _reply(address, sock.recv())
    except zmq.ZMQError as e:
        raise SideChannelError(f"KV side channel at {address}: {e}") from None
    finally:
        sock.close(linger=0)


async def call_async(address: str, message, timeout_s: float) -> Reply:
    """`call` for an asyncio loop."""
    sock = zmq.asyncio.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        await sock.send(messages.encode(message))
        if not await sock.poll(int(timeout_s * 1000)):
            raise _no_answer(address, timeout_s)
        return _reply(address, await sock.recv())
    except zmq.ZMQError as e:
        raise SideChannelError(f"KV side channel at {address}: {e}") from None
    finally:
        sock.close(linger=0)


class Caller:
    """Makes side-channel calls on a background thread so the engine loop never waits on the
    network: `submit(key, address, message)`, later `results()` -> [(key, Reply | error text)]."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._jobs: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="m3serve-kv-caller", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, key, address: str, message) -> None:
        self._pending += 1
        self._jobs.put((key, address, message))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            key, address, message = job
            try:
                result = call(address, message, self.timeout_s)
            except Exception as e:
                result = str(e)
            self._results.put((key, result))

    def results(self) -> list:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                break
        self._pending -= len(out)
        return out

    def close(self) -> None:
        self._jobs.put(None)
