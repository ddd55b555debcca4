"""What the endpoint modules share: the server context (engine, template, parsers, names),
the model-name check, SSE framing, usage blocks, and the merge of several prompts' streams.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from m3serve.engine.errors import EngineDeadError, RequestFailed
from m3serve.serving.openai.engine import ServingEngine
from m3serve.serving.openai.protocol import APIError, error_body
from m3serve.serving.output_processor import RequestState
from m3serve.serving.signing import ReasoningSigner

logger = logging.getLogger(__name__)


@dataclass
class ServerContext:
    """Everything a handler needs, built once the engine is ready."""

    engine: ServingEngine
    model_name: str
    model_root: str
    chat_template: str
    default_chat_template_kwargs: dict = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    kv_transfer: object = None      # config.KVTransferConfig of the engine (None: no P/D)
    stream_interval: int = 1        # a streamed chunk waits for this many new tokens (--stream-interval)
    media: object = None            # serving.media_front.MediaFront: images and video in messages
    signer: ReasoningSigner = field(default_factory=ReasoningSigner)   # reasoning that travels via clients
    created: int = field(default_factory=lambda: int(time.time()))    # the model's `created` (/v1/models)

    def check_model(self, model: str | None) -> None:
        """A request naming another model is a 404, as in vLLM and OpenAI."""
        if model is not None and model != self.model_name and model != self.model_root:
            raise APIError(404, f"The model `{model}` does not exist.", "model")


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
_DISCONNECT_POLL_S = 0.5


def sse_error(status: int, message: str) -> str:
    return sse(error_body(status, message))


def internal_error(e: BaseException) -> str:
    """The client's message for a failure of m3serve itself: generic, with a reference to the
    log line that holds the details (never the exception's text)."""
    ref = uuid.uuid4().hex[:12]
    logger.error("internal error %s: %s: %s", ref, type(e).__name__, e, exc_info=e)
    return f"internal server error (reference {ref} in the server log)"


def engine_error_event(e: BaseException) -> str:
    """The SSE error event of a stream the engine ended: 503 when it is not running (the
    message says why), else a generic 500."""
    if isinstance(e, EngineDeadError):
        return sse_error(503, str(e))
    if isinstance(e, RequestFailed):
        return sse_error(400, str(e))
    return sse_error(500, internal_error(e))


def kv_transfer_field(states: list[RequestState], asked: bool) -> dict:
    """The top-level `kv_transfer_params` of a response whose request carried some."""
    if not asked:
        return {}
    return {"kv_transfer_params": next((s.sequences[0].kv_transfer_params for s in states
                                        if s.sequences[0].kv_transfer_params), None)}


def usage_block(states: list[RequestState]) -> dict:
    """OpenAI usage over all prompts and choices; a prompt counts once however large n is."""
    prompt = sum(len(s.prompt_token_ids) for s in states)
    completion = sum(len(seq.token_ids) for s in states for seq in s.sequences)
    cached = sum(s.sequences[0].num_cached_tokens for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def admit(streams: list[AsyncIterator[RequestState]]) -> list[AsyncIterator[RequestState]]:
    """Advance every stream to its admission point (ServingEngine.generate's first yield) at
    once, so a request's prompts reach the engine together (one message) and an engine refusal
    raises here, before any response is sent. On a refusal every stream is closed (their
    requests aborted)."""
    results = await asyncio.gather(*(stream.__anext__() for stream in streams), return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        for stream in streams:
            await stream.aclose()
        raise failure
    return list(streams)


class ClientDisconnected(Exception):
    """The client went away before its non-streaming response was ready."""


async def collect(streams: list[AsyncIterator[RequestState]], is_disconnected) -> list[RequestState]:
    """Run admitted streams to the end (non-streaming responses), one final state per stream.
    `is_disconnected` (an async callable) is polled; when the client has gone, the streams are
    closed, which aborts their requests, and ClientDisconnected is raised."""
    final: dict[int, RequestState] = {}

    async def run() -> None:
        async for index, state in merge(streams):
            final[index] = state

    await run_unless_disconnected(run(), is_disconnected)
    return [final[i] for i in sorted(final)]


async def run_unless_disconnected(work, is_disconnected) -> None:
    """Await the coroutine `work` while polling `is_disconnected` (an async callable); when the
    client has gone, `work` is cancelled (closing its streams aborts their requests) and
    ClientDisconnected is raised. `work`'s own exception propagates."""
    task = asyncio.create_task(work)
    try:
        while True:
            finished, _ = await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
            if finished:
                task.result()
                return
            if await is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def merge(streams: list[AsyncIterator[RequestState]]) -> AsyncIterator[tuple[int, RequestState]]:
    """Interleave several admitted streams as (prompt index, state); closing the merge closes
    (aborts) every stream still running."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for state in only:
                yield 0, state
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(index: int, stream: AsyncIterator[RequestState]) -> None:
        try:
            async with aclosing(stream):
                async for state in stream:
                    queue.put_nowait((index, state))
        except Exception as e:  # handed to the consumer, which re-raises it
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
