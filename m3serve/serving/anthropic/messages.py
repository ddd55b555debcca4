"""`POST /v1/messages` and `/v1/messages/count_tokens`, the Anthropic Messages dialect of a
chat turn: the request becomes a `TurnRequest` (`convert.chat_form`) and sampling fields; the
turn's typed deltas become content blocks (`blocks.BlockBuilder`), streamed as Anthropic events
or returned as one message. `thinking: {"type": "enabled", "budget_tokens": N}` is the turn's
thinking budget (`chat_turn`: two legs).
"""
from __future__ import annotations

import json
import logging
import uuid
from contextlib import aclosing

from fastapi.responses import JSONResponse, StreamingResponse

from m3serve.engine.errors import EngineDeadError, EngineError, RequestFailed
from m3serve.serving.anthropic.blocks import BlockBuilder
from m3serve.serving.anthropic.convert import ChatForm, chat_form
from m3serve.serving.anthropic.protocol import CountTokensRequest, MessagesRequest, error_body
from m3serve.serving.chat_turn import ChatTurn, ToolUse, TurnRequest
from m3serve.serving.context import ServerContext, run_unless_disconnected
from m3serve.serving.errors import internal_error
from m3serve.serving.sampling import shared_fields

logger = logging.getLogger(__name__)

# The Messages API always splits M3's thinking and tool markup into blocks (it has no
# plain-text form of either): without the server flags these parsers are used.
DEFAULT_PARSER = "minimax_m3"


def turn_request(ctx: ServerContext, request: CountTokensRequest) -> tuple[TurnRequest, ChatForm]:
    """The chat turn a request asks for, and its chat form (ValueError names the field)."""
    form = chat_form(request, ctx.signer)
    kwargs = dict(ctx.default_chat_template_kwargs)
    if form.thinking_mode is not None:
        kwargs["thinking_mode"] = form.thinking_mode
    if form.reasoning_effort is not None:
        kwargs["reasoning_effort"] = form.reasoning_effort
    tool_use = ToolUse(form.tools, form.tool_choice, None)
    if form.tools and form.tool_choice != "none":      # the schemas are checked here
        tool_use = ToolUse.checked(form.tools, form.tool_choice, ctx.tool_call_parser or DEFAULT_PARSER)
    return TurnRequest(form.messages, tool_use, kwargs, ctx.reasoning_parser or DEFAULT_PARSER), form


def render(ctx: ServerContext, request: CountTokensRequest) -> tuple[ChatTurn, ChatForm]:
    """Convert, validate and render a request (call off the event loop)."""
    turn, form = turn_request(ctx, request)
    return ChatTurn.render(ctx, turn), form


async def prepare(ctx: ServerContext, request: CountTokensRequest) -> tuple[ChatTurn, ChatForm]:
    """`render` off the event loop, then the images: fetched, decoded and expanded into their
    placeholder spans (counted in the prompt's tokens)."""
    turn, form = await ctx.engine.off_loop(render, ctx, request)
    await turn.add_media()
    return turn, form


async def count_tokens(ctx: ServerContext, request: CountTokensRequest) -> dict:
    ctx.check_model(request.model)
    turn, _ = await prepare(ctx, request)
    return {"input_tokens": len(turn.token_ids)}


class _Answer:
    """How the turn ended, in Anthropic's words: `stop_reason`, `stop_sequence` and `usage`."""

    def __init__(self, turn: ChatTurn, stops: list[str]):
        self.turn, self.stops = turn, stops

    @property
    def stop_sequence(self) -> str | None:
        """The stop sequence that ended a leg (the last such), None when none did."""
        found = None
        for finish, stop in self.turn.leg_ends:
            if finish == "stop" and isinstance(stop, str) and stop in self.stops:
                found = stop
        return found

    def _finish_reason(self) -> str | None:
        if not self.turn.leg_ends:
            return None
        finish, stop = self.turn.leg_ends[-1]
        if finish == "length":
            return "max_tokens"
        if finish == "stop" and isinstance(stop, str) and stop in self.stops:
            return "stop_sequence"
        return "end_turn"

    def stop_reason(self, builder: BlockBuilder) -> str:
        finish = self._finish_reason()
        if builder.has_tool_use and finish != "max_tokens":
            return "tool_use"
        return finish or "end_turn"

    def usage(self) -> dict:
        """Anthropic's buckets: input_tokens + cache_read_input_tokens = the prompt's tokens."""
        usage = self.turn.usage()
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        return {"input_tokens": usage.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": usage.output_tokens}


async def _start(ctx: ServerContext, request: MessagesRequest, turn: ChatTurn, form: ChatForm, message_id: str,
                 arrival_time: float) -> _Answer:
    """Sampling (the thinking budget's legs, module docstring) and submission; the engine's
    refusal raises here, before any response."""
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {request.max_tokens}")
    max_tokens = turn.resolve_max_tokens(request.max_tokens)
    stops = list(request.stop_sequences or [])
    if any(not s for s in stops):
        raise ValueError("stop_sequences: must not contain an empty string")
    budget = form.budget_tokens if turn.thinking_mode == "enabled" else None
    params = turn.sampling_params({**shared_fields(request), "stop": stops or None}, max_tokens)
    if budget is None:
        turn.constrain_tools(params)
    await turn.start(message_id, params, arrival_time, thinking_budget=budget, open_arguments=True)
    return _Answer(turn, stops)


async def create_message(ctx: ServerContext, request: MessagesRequest, arrival_time: float, is_disconnected):
    ctx.check_model(request.model)
    turn, form = await prepare(ctx, request)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    answer = await _start(ctx, request, turn, form, message_id, arrival_time)
    [parsers] = turn.parsers
    builder = BlockBuilder(parsers, ctx.signer, form.show_thinking)
    if request.stream:
        return StreamingResponse(_events(request, turn, answer, builder, message_id), media_type="text/event-stream")
    await _complete(turn, builder, is_disconnected)
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": request.model,
                         "content": builder.content, "stop_reason": answer.stop_reason(builder),
                         "stop_sequence": answer.stop_sequence, "usage": answer.usage()})


async def _complete(turn: ChatTurn, builder: BlockBuilder, is_disconnected) -> None:
    """Run the turn to the end for a non-streaming response; a client that went away aborts
    it (ClientDisconnected)."""
    async def consume():
        async with aclosing(turn.deltas()) as steps:
            async for deltas in steps:
                builder.add(deltas)
        builder.add([], finished=True)

    await run_unless_disconnected(consume(), is_disconnected)


def _event(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def stream_error_event(e: BaseException) -> str:
    if isinstance(e, EngineDeadError):
        return _event(error_body(503, str(e)))
    if isinstance(e, (RequestFailed, ValueError)):
        return _event(error_body(400, str(e)))
    return _event(error_body(500, internal_error(e)))


async def _events(request: MessagesRequest, turn: ChatTurn, answer: _Answer, builder: BlockBuilder,
                  message_id: str):
    """Anthropic's event sequence: message_start, ping, the content blocks' events,
    message_delta (stop reason, usage), message_stop; an `error` event if the engine fails.
    message_start waits for the first output, when the prompt's prefix-cache hit is known, so
    its usage splits the prompt as the final message_delta does."""
    started = False

    def start() -> list[str]:
        """message_start and ping, the first time only."""
        nonlocal started
        if started:
            return []
        started = True
        usage = {**answer.usage(), "output_tokens": 0}
        return [_event({"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": request.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}}), _event({"type": "ping"})]
    try:
        async with aclosing(turn.deltas()) as steps:
            async for deltas in steps:
                for event in [*start(), *map(_event, builder.add(deltas))]:
                    yield event
        for event in [*start(), *map(_event, builder.add([], finished=True))]:
            yield event
    except (EngineError, ValueError) as e:
        for event in start():
            yield event
        yield stream_error_event(e)
        return
    yield _event({"type": "message_delta", "delta": {"stop_reason": answer.stop_reason(builder),
                                                     "stop_sequence": answer.stop_sequence},
                  "usage": answer.usage()})
    yield _event({"type": "message_stop"})


def log_ignored(request, beta: str | None) -> None:
    """What Claude Code and newer SDKs send that does not apply here, at debug level."""
    if request.not_applicable():
        logger.debug("messages: ignoring fields that do not apply here: %s", request.not_applicable())
    if beta:
        logger.debug("messages: anthropic-beta %s (accepted; no beta behaviour applies)", beta)
