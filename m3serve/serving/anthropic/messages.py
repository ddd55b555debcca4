"""`POST /v1/messages` and `/v1/messages/count_tokens`: the Anthropic Messages API over the
chat template, the engine and M3's reasoning and tool-call parsers.

Thinking budget: with `thinking: {"type": "enabled", "budget_tokens": N}` the output is generated
in two legs. The first generates the thinking, at most N tokens, up to the model's own
`</mm:think>`; when the budget runs out first, the server closes the block itself ("\n</mm:think>\n"
appended to the prompt, as the template renders a finished thinking block) and the second leg
generates the answer from there, with the rest of `max_tokens`. The legs share the prompt
prefix, so the second one's prefill is mostly a prefix-cache hit.
"""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi.responses import JSONResponse, StreamingResponse

from m3serve.engine.errors import EngineDeadError, EngineError, RequestFailed
from m3serve.sampling_params import SamplingParams, StructuredOutputsParams
from m3serve.serving.anthropic.blocks import BlockBuilder
from m3serve.serving.anthropic.convert import ChatForm, chat_form
from m3serve.serving.anthropic.protocol import CountTokensRequest, MessagesRequest, error_body
from m3serve.serving.chat_template import render_chat
from m3serve.serving.openai.common import ServerContext, admit, internal_error, run_unless_disconnected
from m3serve.model.markup import THINK_CLOSE
from m3serve.structured.tool_grammar import tool_call_grammar
from m3serve.serving.tool_parser import get_tool_parser

logger = logging.getLogger(__name__)

# The Messages API always splits M3's thinking and tool markup into blocks (it has no
# plain-text form of either): without the server flags these parsers are used.
DEFAULT_PARSER = "minimax_m3"
_CLOSE_THINKING = "\n" + THINK_CLOSE + "\n"


@dataclass
class Prompt:
    """A rendered Messages request."""

    text: str
    token_ids: list[int]
    form: ChatForm
    thinking_mode: str | None       # the template's mode in effect (request, else server default)
    tool_parser: str | None         # None: no tool parsing (no tools, or tool_choice none)
    mm_inputs: list | None = None   # the request's images (protocol.MultiModalInput), in order


def render(ctx: ServerContext, request: CountTokensRequest) -> Prompt:
    """Convert, validate and render a request (call off the event loop); ValueError names the field."""
    form = chat_form(request, ctx.signer)
    kwargs = dict(ctx.default_chat_template_kwargs)
    if form.thinking_mode is not None:
        kwargs["thinking_mode"] = form.thinking_mode
    if form.reasoning_effort is not None:
        kwargs["reasoning_effort"] = form.reasoning_effort
    tool_parser = None
    if form.tools and form.tool_choice != "none":
        tool_parser = ctx.tool_call_parser or DEFAULT_PARSER
        get_tool_parser(tool_parser)(form.tools, form.tool_choice)      # checks the tool schemas
    text = render_chat(ctx.chat_template, form.messages, tools=form.tools, add_generation_prompt=True,
                       chat_template_kwargs=kwargs)
    return Prompt(text, ctx.engine.encode(text), form, kwargs.get("thinking_mode"), tool_parser)


async def render_with_media(ctx: ServerContext, request: CountTokensRequest) -> Prompt:
    """`render` off the event loop, then the images: fetched, decoded and expanded into their
    placeholder spans (counted in the prompt's tokens)."""
    prompt = await ctx.engine.off_loop(render, ctx, request)
    if ctx.media is not None:
        prompt.token_ids, prompt.mm_inputs = await ctx.media.prepare(prompt.form.messages, prompt.token_ids)
    return prompt


async def count_tokens(ctx: ServerContext, request: CountTokensRequest) -> dict:
    ctx.check_model(request.model)
    prompt = await render_with_media(ctx, request)
    return {"input_tokens": len(prompt.token_ids)}


def _params(request: MessagesRequest, ctx: ServerContext, max_tokens: int, stop: list[str],
            grammar: str | None) -> SamplingParams:
    optional = {k: v for k, v in ctx.engine.sampling_defaults.items() if k != "max_tokens"}
    optional |= {k: v for k, v in (("temperature", request.temperature), ("top_p", request.top_p),
                                   ("top_k", request.top_k)) if v is not None}
    return SamplingParams(max_tokens=max_tokens, stop=stop or None, **optional,
                          structured_outputs=StructuredOutputsParams(grammar=grammar) if grammar else None)


class Generation:
    """One response's generation: one leg, or two with a thinking budget (module docstring).
    `texts()` yields the text the parsers read: the model's output, plus the `</mm:think>` the
    server writes when it closes the thinking block. Afterwards `finish_reason`,
    `stop_sequence`, `num_output_tokens` and `num_cached_tokens` describe the whole."""

    def __init__(self, ctx: ServerContext, request: MessagesRequest, prompt: Prompt, request_id: str,
                 arrival_time: float):
        self.ctx, self.prompt, self.request_id, self.arrival = ctx, prompt, request_id, arrival_time
        self.request = request
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {request.max_tokens}")
        self.max_tokens = ctx.engine.resolve_max_tokens(len(prompt.token_ids), request.max_tokens)
        self.stops = list(request.stop_sequences or [])
        if any(not s for s in self.stops):
            raise ValueError("stop_sequences: must not contain an empty string")
        form = prompt.form
        self.budget = form.budget_tokens if prompt.thinking_mode == "enabled" else None
        forced = prompt.tool_parser is not None and form.tool_choice != "auto"
        self._grammar = ((lambda mode: tool_call_grammar(form.tools, form.tool_choice, mode)) if forced
                         else (lambda mode: None))
        if self.budget is not None:
            first = _params(request, ctx, min(self.budget, self.max_tokens), self.stops + [THINK_CLOSE], None)
        else:
            first = _params(request, ctx, self.max_tokens, self.stops, self._grammar(prompt.thinking_mode))
        self._first_params = first
        self._stream = None
        self._seq = None                # the last leg's final SequenceState
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0

    async def start(self) -> None:
        """Submit the first leg; the engine's refusal raises here, before any response."""
        stream = self.ctx.engine.generate(self.request_id, self.prompt.text, self.prompt.token_ids,
                                          self._first_params, self.arrival, mm_inputs=self.prompt.mm_inputs)
        [self._stream] = await admit([stream])
        if self.budget is None:
            self.prompt.mm_inputs = None     # no second leg: the engine has the pixels

    async def _leg(self, stream, first: bool = False) -> AsyncIterator[str]:
        seq = None
        async with aclosing(stream) as states:
            async for state in states:
                seq = state.sequences[0]
                if first:           # the prefix-cache hit is known from the first output on
                    self.num_cached_tokens = seq.num_cached_tokens
                delta = seq.text_delta()
                if delta:
                    yield delta
        self._seq = seq

    async def texts(self) -> AsyncIterator[str]:
        async for text in self._leg(self._stream, first=True):
            yield text
        first = self._seq
        self.num_output_tokens = len(first.token_ids)
        self._finish(first)
        if self.budget is None:
            return
        closed = first.stop_reason == THINK_CLOSE
        out_of_budget = first.finish_reason == "length" and len(first.token_ids) < self.max_tokens
        if not (closed or out_of_budget):
            return                      # the end of the output (eos, a stop sequence, max_tokens)
        written = "\n" if closed else _CLOSE_THINKING
        yield THINK_CLOSE + "\n"        # for the parsers: the thinking ends here
        # the model's tokens (a closing tag it wrote ends them) and what the server wrote
        ids = (self.prompt.token_ids + first.token_ids
               + self.ctx.engine.tokenizer.encode(written, add_special_tokens=False).ids)
        remaining = min(self.max_tokens - len(first.token_ids), self.ctx.engine.max_total_tokens - len(ids))
        if remaining < 1:
            self.finish_reason = "max_tokens"
            return
        params = _params(self.request, self.ctx, remaining, self.stops, self._grammar("disabled"))
        stream = self.ctx.engine.generate(self.request_id + "-answer", None, ids, params, self.arrival,
                                          mm_inputs=self.prompt.mm_inputs)
        [stream] = await admit([stream])
        async for text in self._leg(stream):
            yield text
        self.num_output_tokens += len(self._seq.token_ids)
        self._finish(self._seq)

    def _finish(self, seq) -> None:
        if seq.finish_reason == "length":
            self.finish_reason = "max_tokens"
        elif seq.finish_reason == "stop" and isinstance(seq.stop_reason, str) and seq.stop_reason in self.stops:
            self.finish_reason, self.stop_sequence = "stop_sequence", seq.stop_reason
        else:
            self.finish_reason = "end_turn"

    def stop_reason(self, builder: BlockBuilder) -> str:
        if builder.has_tool_use and self.finish_reason != "max_tokens":
            return "tool_use"
        return self.finish_reason or "end_turn"

    def usage(self) -> dict:
        """Anthropic's buckets: input_tokens + cache_read_input_tokens = the prompt's tokens."""
        cached = min(self.num_cached_tokens, len(self.prompt.token_ids))
        return {"input_tokens": len(self.prompt.token_ids) - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": self.num_output_tokens}


def _builder(prompt: Prompt, ctx: ServerContext) -> BlockBuilder:
    return BlockBuilder(ctx.reasoning_parser or DEFAULT_PARSER, prompt.thinking_mode, prompt.tool_parser,
                        prompt.form.tools, prompt.form.tool_choice, ctx.signer, prompt.form.show_thinking)


async def create_message(ctx: ServerContext, request: MessagesRequest, arrival_time: float, is_disconnected):
    ctx.check_model(request.model)
    prompt = await render_with_media(ctx, request)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    run = Generation(ctx, request, prompt, message_id, arrival_time)
    await run.start()
    builder = _builder(prompt, ctx)
    if request.stream:
        return StreamingResponse(_events(ctx, request, run, builder, message_id), media_type="text/event-stream")
    await _complete(run, builder, is_disconnected)
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": request.model,
                         "content": builder.content, "stop_reason": run.stop_reason(builder),
                         "stop_sequence": run.stop_sequence, "usage": run.usage()})


async def _complete(run: Generation, builder: BlockBuilder, is_disconnected) -> None:
    """Run the generation to the end for a non-streaming response; a client that went away
    aborts it (ClientDisconnected)."""
    async def consume():
        async with aclosing(run.texts()) as texts:
            async for text in texts:
                builder.feed(text)
        builder.feed("", finished=True)

    await run_unless_disconnected(consume(), is_disconnected)


def _event(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def stream_error_event(e: BaseException) -> str:
    if isinstance(e, EngineDeadError):
        return _event(error_body(503, str(e)))
    if isinstance(e, (RequestFailed, ValueError)):
        return _event(error_body(400, str(e)))
    return _event(error_body(500, internal_error(e)))


async def _events(ctx: ServerContext, request: MessagesRequest, run: Generation, builder: BlockBuilder,
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
        usage = {**run.usage(), "output_tokens": 0}
        return [_event({"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": request.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}}), _event({"type": "ping"})]
    try:
        async with aclosing(run.texts()) as texts:
            async for text in texts:
                for event in [*start(), *map(_event, builder.feed(text))]:
                    yield event
        for event in [*start(), *map(_event, builder.feed("", finished=True))]:
            yield event
    except (EngineError, ValueError) as e:
        for event in start():
            yield event
        yield stream_error_event(e)
        return
    yield _event({"type": "message_delta", "delta": {"stop_reason": run.stop_reason(builder),
                                                     "stop_sequence": run.stop_sequence},
                  "usage": run.usage()})
    yield _event({"type": "message_stop"})


def log_ignored(request, beta: str | None) -> None:
    """What Claude Code and newer SDKs send that does not apply here, at debug level."""
    if request.not_applicable():
        logger.debug("messages: ignoring fields that do not apply here: %s", request.not_applicable())
    if beta:
        logger.debug("messages: anthropic-beta %s (accepted; no beta behaviour applies)", beta)
