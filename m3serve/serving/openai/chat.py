"""`POST /v1/chat/completions`: chat template, n choices, and per choice the reasoning parser
followed by the tool-call parser (reasoning first; its content feeds the tool parser), streamed
as SSE deltas or returned as one message, with `reasoning_content` (and `reasoning`) fields.
"""
from __future__ import annotations

import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from m3serve.engine.errors import EngineError
from m3serve.sampling_params import StructuredOutputsParams
from m3serve.serving.chat_template import render_chat, template_kwargs
from m3serve.serving.openai.common import (SSE_DONE, ServerContext, admit, collect, kv_transfer_field, merge,
                                           sse, engine_error_event, usage_block)
from m3serve.serving.openai.engine import clamp_logprob, prompt_logprobs_field, top_entries
from m3serve.serving.openai.kv_transfer import resolve_kv_transfer
from m3serve.serving.openai.protocol import ChatCompletionRequest
from m3serve.serving.output_processor import SequenceState
from m3serve.serving.reasoning import get_reasoning_parser
from m3serve.structured.tool_grammar import tool_call_grammar
from m3serve.serving.tool_parser import get_tool_parser


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
    """One choice's parsers: reasoning split first, then tool calls out of the content."""

    def __init__(self, ctx: ServerContext, thinking_mode, tools, tool_choice, use_tools: bool):
        self.reasoning = (get_reasoning_parser(ctx.reasoning_parser)(thinking_mode)
                          if ctx.reasoning_parser else None)
        self.tools = get_tool_parser(ctx.tool_call_parser)(tools, tool_choice) if use_tools else None
        self.named = isinstance(tool_choice, dict)
        self.forced = use_tools and tool_choice != "auto"     # "required" or named
        self.made_calls = False

    def _content(self, text: str | None) -> str | None:
        """Content as sent: with a forced tool call the grammar allows no content, only the
        newline the template puts after reasoning, which is not sent."""
        return None if self.forced and not (text or "").strip() else text

    def finish_reason(self, seq: SequenceState) -> str | None:
        """OpenAI's: "tool_calls" when calls were made, except for a named tool_choice ("stop");
        "length" whenever max_tokens (or the context) cut the output, calls or not, so that a
        client never runs a call that may be incomplete believing it whole."""
        if seq.finish_reason == "length":
            return "length"
        return "tool_calls" if self.made_calls and not self.named else seq.finish_reason

    def whole(self, text: str) -> dict:
        reasoning, content = self.reasoning.extract(text) if self.reasoning else (None, text)
        message = {"role": "assistant", "content": content, "reasoning_content": reasoning,
                   "reasoning": reasoning, "tool_calls": []}
        if self.tools is not None:
            result = self.tools.extract(content or "")
            message["content"], message["tool_calls"] = self._content(result.content), result.tool_calls
            self.made_calls = bool(result.tool_calls)
        return message

    def delta(self, text: str, finished: bool) -> dict:
        reasoning, content = self.reasoning.stream(text) if self.reasoning else (None, text)
        if finished and self.reasoning:
            tail_reasoning, tail_content = self.reasoning.finish()
            reasoning = ((reasoning or "") + (tail_reasoning or "")) or None
            content = ((content or "") + (tail_content or "")) or None
        delta: dict = {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        calls = []
        if self.tools is not None:
            parsed = self.tools.stream(content or "")
            content, calls = parsed.content, parsed.tool_call_deltas
            if finished:
                tail = self.tools.finish()
                content = ((content or "") + (tail.content or "")) or None
                calls = calls + tail.tool_call_deltas
            self.made_calls = self.made_calls or self.tools.has_tool_calls
        content = self._content(content)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta


def _tool_setup(ctx: ServerContext, request: ChatCompletionRequest):
    """(tools as dicts or None, tool_choice, whether to run the tool parser)."""
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    tool_choice = request.tool_choice if request.tool_choice is not None else ("auto" if tools else "none")
    if not tools or tool_choice == "none":
        if tool_choice not in ("none", "auto"):
            raise ValueError(f"tool_choice {tool_choice!r} needs a non-empty tools list")
        return tools, "none", False
    if ctx.tool_call_parser is None or (tool_choice == "auto" and not ctx.enable_auto_tool_choice):
        raise ValueError('tool_choice "auto" requires the server flags --enable-auto-tool-choice and '
                         '--tool-call-parser' if tool_choice == "auto" else
                         f"tool_choice {tool_choice!r} requires the server flag --tool-call-parser")
    get_tool_parser(ctx.tool_call_parser)(tools, tool_choice)  # validates tool_choice and schemas
    return tools, tool_choice, True


def render_request(ctx: ServerContext, request: ChatCompletionRequest):
    """(prompt text, token ids, (tools, tool_choice, use_tools), template kwargs) of a request."""
    tool_setup = _tool_setup(ctx, request)
    kwargs = template_kwargs(ctx.default_chat_template_kwargs, request.chat_template_kwargs,
                             request.reasoning_effort)
    prompt = render_chat(ctx.chat_template, request.messages, tools=tool_setup[0],
                         add_generation_prompt=request.add_generation_prompt, chat_template_kwargs=kwargs)
    return prompt, ctx.engine.encode(prompt), tool_setup, kwargs


async def create_chat_completion(ctx: ServerContext, request: ChatCompletionRequest, arrival_time: float,
                                 is_disconnected):
    created = int(time.time())      # the response's (and each of its chunks')
    ctx.check_model(request.model)
    if request.top_logprobs is not None and not request.logprobs:
        raise ValueError("top_logprobs requires logprobs to be true")
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
        raise ValueError(f"top_logprobs must be in [0, 20], got {request.top_logprobs}")
    prompt, ids, (tools, tool_choice, use_tools), kwargs = await ctx.engine.off_loop(render_request, ctx, request)
    mm_inputs = None
    if ctx.media is not None:
        ids, mm_inputs = await ctx.media.prepare(request.messages, ids, request.mm_processor_kwargs)
    if request.max_completion_tokens is not None and request.max_tokens is not None and request.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")   # checked though unused
    field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = ctx.engine.resolve_max_tokens(len(ids), getattr(request, field), field)
    k = (request.top_logprobs or 0) if request.logprobs else None
    params = request.sampling_params(max_tokens, k, ctx.engine.sampling_defaults)
    ctx.engine.check_fan_out(1, request.n)
    forced_tools = use_tools and tool_choice != "auto"
    if params.structured_outputs is not None and not forced_tools and kwargs.get("thinking_mode") == "enabled":
        # the grammar holds from the first output token: the opened thinking block would hold
        # the constrained output and the answer would be empty (Responses' text.format rule)
        raise ValueError(f"{params.structured_outputs.field_name}: a structured output cannot follow forced "
                         f"thinking (thinking_mode enabled); use reasoning_effort none, minimal, low or medium, "
                         f"or chat_template_kwargs.thinking_mode adaptive")
    if forced_tools:
        # "required" / named: the output is constrained to the model's tool-call markup (this
        # replaces any response_format, as in vLLM); the tool parser reads it back as usual.
        params.structured_outputs = StructuredOutputsParams(
            grammar=tool_call_grammar(tools, tool_choice, kwargs.get("thinking_mode")))
    kv = await resolve_kv_transfer(ctx, request.kv_transfer_params, [ids], request.n)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    [stream] = await admit([ctx.engine.generate(request_id, prompt, ids, params, arrival_time,
                                                request.cache_salt, kv, mm_inputs=mm_inputs)])
    del mm_inputs                    # the engine has the pixels
    choices = [_Choice(ctx, kwargs.get("thinking_mode"), tools, tool_choice, use_tools)
               for _ in range(request.n)]
    header = {"id": request_id, "object": "chat.completion", "created": created, "model": ctx.model_name}
    if request.stream:
        return StreamingResponse(_stream({**header, "object": "chat.completion.chunk"}, request, stream, choices,
                                         ctx.stream_interval, ids),
                                 media_type="text/event-stream")
    [state] = await collect([stream], is_disconnected)
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


async def _stream(header: dict, request: ChatCompletionRequest, stream, choices: list[_Choice],
                  stream_interval: int, prompt_token_ids: list[int]):
    k = (request.top_logprobs or 0) if request.logprobs else None
    prompt_ids = {"prompt_token_ids": prompt_token_ids} if request.return_token_ids else {}
    for i in range(request.n):
        yield sse({**header, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}], **prompt_ids})
    sent_tokens = [0] * request.n
    done = [False] * request.n
    state = None
    try:
        async for _, state in merge([stream]):
            for seq, choice in zip(state.sequences, choices):
                if done[seq.index]:
                    continue
                start, end = sent_tokens[seq.index], len(seq.token_ids)
                if not seq.finished and end - start < stream_interval:
                    continue          # --stream-interval: the next chunk carries these tokens too
                delta = choice.delta(seq.text_delta(), seq.finished)
                if not delta and start == end and not seq.finished:
                    continue
                sent_tokens[seq.index] = end
                finish_reason = None
                if seq.finished:
                    done[seq.index] = True
                    finish_reason = choice.finish_reason(seq)
                yield sse({**header, "choices": [{
                    "index": seq.index, "delta": delta,
                    "logprobs": _logprobs(seq, start, end, k) if k is not None else None,
                    "finish_reason": finish_reason,
                    **({"token_ids": seq.token_ids[start:end]} if request.return_token_ids else {}),
                    **({"stop_reason": seq.stop_reason} if seq.finished else {})}],
                    **(kv_transfer_field([state], request.kv_transfer_params is not None)
                       if seq.finished else {})})
        if request.include_usage and state is not None:
            yield sse({**header, "choices": [], "usage": usage_block([state])})
    except EngineError as e:
        yield engine_error_event(e)
    yield SSE_DONE
