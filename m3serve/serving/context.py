"""What every API dialect's handlers share: the server context (engine, template, parser
names, media, signer), the model-name check, and the life of admitted engine streams (admit
together, collect with disconnect polling, merge several prompts' streams).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from m3serve.serving.errors import APIError, ClientDisconnected
from m3serve.serving.output_processor import RequestState
from m3serve.serving.serving_engine import ServingEngine
from m3serve.serving.signing import ReasoningSigner

_DISCONNECT_POLL_S = 0.5


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
