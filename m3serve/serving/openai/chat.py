"""`POST /v1/chat/completions`, the OpenAI Chat Completions dialect of a chat turn: the request
becomes a `TurnRequest` and sampling fields, and each choice's typed deltas become SSE chunks or
one message, with `reasoning_content` (and `reasoning`) fields, logprobs and usage.
"""
from __future__ import annotations

import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from m3serve.engine.errors import EngineError
from m3serve.serving.chat_template import template_kwargs
from m3serve.serving.chat_turn import ChatTurn, ToolUse, TurnRequest
from m3serve.serving.context import ServerContext, collect
from m3serve.serving.openai.common import SSE_DONE, engine_error_event, kv_transfer_field, sse, usage_block
from m3serve.serving.openai.logprobs import clamp_logprob, prompt_logprobs_field, top_entries
from m3serve.serving.openai.kv_transfer import resolve_kv_transfer
from m3serve.serving.openai.protocol import ChatCompletionRequest
from m3serve.serving.output_parsers import OutputParsers, combine
from m3serve.serving.output_processor import SequenceState


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _logprobs(seq: SequenceState, start: int, end: int, k: int) -> dict:
    """Chat-style logprobs ({"content": [...]}) of output positions [start, end)."""
    content = []
    for position, token_id in zip(seq.logprobs[start:end], seq.token_ids[start:end]):
        chosen = position[token_id]
        text = chosen.decoded_token or ""
        content.append({
            "token": text, "logprob": clamp_logprob(chosen.logprob), "bytes": _token_bytes(text),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": _token_bytes(t)}
                             for _, lp, t in top_entries(position, k)]})
    return {"content": content}


class _Choice:
    """One choice's deltas as OpenAI chat message fields, and its finish reason."""

    def __init__(self, tool_use: ToolUse, parsers: OutputParsers):
        self.tool_use, self.parsers = tool_use, parsers
        self.named = isinstance(tool_use.tool_choice, dict)
        self.made_calls = False

    def finish_reason(self, seq: SequenceState) -> str | None:
        """OpenAI's: "tool_calls" when calls were made, except for a named tool_choice ("stop");
        "length" whenever max_tokens (or the context) cut the output, calls or not, so that a
        client never runs a call that may be incomplete believing it whole."""
        if seq.finish_reason == "length":
            return "length"
        return "tool_calls" if self.made_calls and not self.named else seq.finish_reason

    def whole(self, text: str) -> dict:
        out = self.parsers.whole(text)
        message = {"role": "assistant", "content": out.content, "reasoning_content": out.reasoning,
                   "reasoning": out.reasoning, "tool_calls": []}
        if self.parsers.tools is not None:
            message["content"], message["tool_calls"] = self.tool_use.visible_content(out.content), out.tool_calls
            self.made_calls = bool(out.tool_calls)
        return message

    def delta(self, deltas: list) -> dict:
        step = combine(deltas)
        self.made_calls = self.made_calls or self.parsers.has_tool_calls
        delta: dict = {}
        if step.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = step.reasoning
        content = self.tool_use.visible_content(step.content)
        if content:
            delta["content"] = content
        if step.tool_calls:
            delta["tool_calls"] = step.tool_calls
        return delta


def _tool_use(ctx: ServerContext, request: ChatCompletionRequest) -> ToolUse:
    """The request's tools, tool_choice and tool parser (None: the output is not parsed for calls)."""
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    tool_choice = request.tool_choice if request.tool_choice is not None else ("auto" if tools else "none")
    if not tools or tool_choice == "none":
        if tool_choice not in ("none", "auto"):
            raise ValueError(f"tool_choice {tool_choice!r} needs a non-empty tools list")
        return ToolUse(tools, "none", None)
    if ctx.tool_call_parser is None or (tool_choice == "auto" and not ctx.enable_auto_tool_choice):
        raise ValueError('tool_choice "auto" requires the server flags --enable-auto-tool-choice and '
                         '--tool-call-parser' if tool_choice == "auto" else
                         f"tool_choice {tool_choice!r} requires the server flag --tool-call-parser")
    return ToolUse.checked(tools, tool_choice, ctx.tool_call_parser)


def turn_request(ctx: ServerContext, request: ChatCompletionRequest) -> TurnRequest:
    """The chat turn a Chat Completions request asks for."""
    tool_use = _tool_use(ctx, request)
    kwargs = template_kwargs(ctx.default_chat_template_kwargs, request.chat_template_kwargs,
                             request.reasoning_effort)
    return TurnRequest(request.messages, tool_use, kwargs, ctx.reasoning_parser, request.add_generation_prompt,
                       request.mm_processor_kwargs)


def render_request(ctx: ServerContext, request: ChatCompletionRequest) -> ChatTurn:
    """The request's turn with its prompt rendered and tokenized (call off the event loop)."""
    return ChatTurn.render(ctx, turn_request(ctx, request))


async def prepare(ctx: ServerContext, request: ChatCompletionRequest) -> ChatTurn:
    """`render_request` off the event loop, then the media (images count as their placeholder spans)."""
    turn = await ctx.engine.off_loop(render_request, ctx, request)
    await turn.add_media()
    return turn


async def create_chat_completion(ctx: ServerContext, request: ChatCompletionRequest, arrival_time: float,
                                 is_disconnected):
    created = int(time.time())      # the response's (and each of its chunks')
    ctx.check_model(request.model)
    if request.top_logprobs is not None and not request.logprobs:
        raise ValueError("top_logprobs requires logprobs to be true")
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
        raise ValueError(f"top_logprobs must be in [0, 20], got {request.top_logprobs}")
    turn = await prepare(ctx, request)
    if request.max_completion_tokens is not None and request.max_tokens is not None and request.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")   # checked though unused
    field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = turn.resolve_max_tokens(getattr(request, field), field)
    k = (request.top_logprobs or 0) if request.logprobs else None
    params = turn.sampling_params(request.sampling_fields(k), max_tokens)
    ctx.engine.check_fan_out(1, request.n)
    if params.structured_outputs is not None and not turn.request.tool_use.forced \
            and turn.thinking_mode == "enabled":
        # the grammar holds from the first output token: the opened thinking block would hold
        # the constrained output and the answer would be empty (Responses' text.format rule)
        raise ValueError(f"{params.structured_outputs.field_name}: a structured output cannot follow forced "
                         f"thinking (thinking_mode enabled); use reasoning_effort none, minimal, low or medium, "
                         f"or chat_template_kwargs.thinking_mode adaptive")
    turn.constrain_tools(params)
    kv = await resolve_kv_transfer(ctx, request.kv_transfer_params, [turn.token_ids], request.n)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    await turn.start(request_id, params, arrival_time, request.cache_salt, kv)
    choices = [_Choice(turn.request.tool_use, parsers) for parsers in turn.parsers]
    header = {"id": request_id, "object": "chat.completion", "created": created, "model": ctx.model_name}
    if request.stream:
        return StreamingResponse(_stream({**header, "object": "chat.completion.chunk"}, request, turn, choices,
                                         ctx.stream_interval),
                                 media_type="text/event-stream")
    [state] = await collect([turn.stream], is_disconnected)
    out = []
    for seq, choice in zip(state.sequences, choices):
        message = choice.whole(seq.text)
        out.append({"index": seq.index, "message": message,
                    "logprobs": _logprobs(seq, 0, len(seq.token_ids), k) if k is not None else None,
                    "finish_reason": choice.finish_reason(seq),
                    "stop_reason": seq.stop_reason,
                    **({"token_ids": seq.token_ids} if request.return_token_ids else {})})
    return JSONResponse({**header, "choices": out, "usage": usage_block([state]),
                         **prompt_logprobs_field(state, request.prompt_logprobs),
                         **({"prompt_token_ids": state.prompt_token_ids} if request.return_token_ids else {}),
                         **kv_transfer_field([state], request.kv_transfer_params is not None)})


async def _stream(header: dict, request: ChatCompletionRequest, turn: ChatTurn, choices: list[_Choice],
                  stream_interval: int):
    k = (request.top_logprobs or 0) if request.logprobs else None
    prompt_ids = {"prompt_token_ids": turn.token_ids} if request.return_token_ids else {}
    for i in range(request.n):
        yield sse({**header, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}], **prompt_ids})
    try:
        async for step in turn.steps(stream_interval):
            seq, choice = step.seq, choices[step.index]
            delta = choice.delta(step.deltas)
            if not delta and step.start == step.end and not step.finished:
                continue
            yield sse({**header, "choices": [{
                "index": step.index, "delta": delta,
                "logprobs": _logprobs(seq, step.start, step.end, k) if k is not None else None,
                "finish_reason": choice.finish_reason(seq) if step.finished else None,
                **({"token_ids": seq.token_ids[step.start:step.end]} if request.return_token_ids else {}),
                **({"stop_reason": seq.stop_reason} if step.finished else {})}],
                **(kv_transfer_field([turn.state], request.kv_transfer_params is not None)
                   if step.finished else {})})
        if request.include_usage and turn.state is not None:
            yield sse({**header, "choices": [], "usage": usage_block([turn.state])})
    except EngineError as e:
        yield engine_error_event(e)
    yield SSE_DONE
