"""One chat turn, whatever API dialect asked for it.

A dialect translates its request into a `TurnRequest` (messages in the chat template's form,
`ToolUse`, template kwargs) and its sampling fields into `SamplingParams` keywords; the turn
does the rest once: renders the prompt (chat template, tokens), fetches the media, resolves
max_tokens, builds `SamplingParams` (the server's defaults, the forced-tool grammar), submits
to the engine and reads every output through `OutputParsers` into typed deltas. A thinking
budget runs the turn in two legs: the thinking, at most the budget's tokens, up to the model's
own `</mm:think>`; when the budget runs out first the server closes the block itself
("\\n</mm:think>\\n" appended to the prompt, as the template renders a finished thinking block)
and the second leg generates the answer from there with the rest of max_tokens. The legs share
the prompt prefix, so the second one's prefill is mostly a prefix-cache hit.

Dialects import this module; it imports none of them.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from m3serve.sampling_params import SamplingParams, StructuredOutputsParams
from m3serve.serving.chat_template import render_chat
from m3serve.serving.context import ServerContext, admit, merge
from m3serve.serving.output_parsers import Delta, OutputParsers
from m3serve.serving.output_processor import RequestState, SequenceState
from m3serve.model.markup import THINK_CLOSE
from m3serve.serving.sampling import build_sampling_params
from m3serve.structured.tool_grammar import tool_call_grammar
from m3serve.serving.tool_parser import get_tool_parser

_CLOSE_THINKING = "\n" + THINK_CLOSE + "\n"


@dataclass(frozen=True)
class ToolUse:
    """The turn's tools: `tools` (OpenAI function shape), `tool_choice` ("none", "auto",
    "required" or `{"type": "function", "function": {"name": ...}}`) and the tool-call parser
    that reads the output (None: no tool parsing)."""

    tools: list[dict] | None = None
    tool_choice: Any = "none"
    parser: str | None = None

    @classmethod
    def checked(cls, tools: list[dict] | None, tool_choice, parser: str | None) -> ToolUse:
        """A ToolUse whose tool_choice and tool schemas the parser accepts (ValueError if not)."""
        if parser is not None:
            get_tool_parser(parser)(tools, tool_choice)
        return cls(tools, tool_choice, parser)

    @property
    def forced(self) -> bool:
        """tool_choice "required" or named: the output must be a tool call."""
        return self.parser is not None and self.tool_choice != "auto"

    def visible_content(self, text: str | None) -> str | None:
        """Content as sent: with a forced tool call the grammar allows no content, only the
        newline the template puts after reasoning, which is not sent."""
        return None if self.forced and not (text or "").strip() else text

    def grammar(self, thinking_mode: str | None) -> StructuredOutputsParams | None:
        """The constraint of a forced tool call: the output is the model's tool-call markup
        (after a reasoning block as `thinking_mode` allows), which the tool parser reads back."""
        if not self.forced:
            return None
        return StructuredOutputsParams(grammar=tool_call_grammar(self.tools, self.tool_choice, thinking_mode))


@dataclass
class TurnRequest:
    """A chat turn in the chat template's terms, as every dialect states it."""

    messages: list[dict]                     # chat-template messages
    tool_use: ToolUse = field(default_factory=ToolUse)
    template_kwargs: dict = field(default_factory=dict)     # resolved: server defaults + request
    reasoning_parser: str | None = None      # None: the output is not split into reasoning
    add_generation_prompt: bool = True
    mm_processor_kwargs: dict | None = None  # per-request image / video processor options

    @property
    def thinking_mode(self) -> str | None:
        return self.template_kwargs.get("thinking_mode")


@dataclass
class TurnStep:
    """What one engine update did to one sequence (choice `index`): its typed `deltas`, the
    output tokens [start, end) they came from, and whether the sequence finished. `seq` is the
    sequence's state (token ids, logprobs, finish and stop reasons)."""

    index: int
    seq: SequenceState
    start: int
    end: int
    deltas: list[Delta]
    finished: bool


@dataclass
class TurnUsage:
    """Token counts of the turn so far (of every leg)."""

    prompt_tokens: int
    output_tokens: int
    cached_tokens: int


class ChatTurn:
    """One request's turn: `prepare` (render, tokens, media), then the sampling steps a dialect
    calls in its own order of checks (`resolve_max_tokens`, `sampling_params`,
    `constrain_tools`), then `start` and one reading: `steps` (n choices, one leg) or `deltas`
    (one sequence, legs of a thinking budget)."""

    def __init__(self, ctx: ServerContext, request: TurnRequest, prompt: str, token_ids: list[int]):
        self.ctx, self.request = ctx, request
        self.prompt, self.token_ids = prompt, token_ids
        self.mm_inputs: list | None = None      # the request's images (protocol.MultiModalInput), in order
        self.request_id, self.arrival = "", 0.0
        self._fields: dict = {}
        self._max_tokens: int | None = None
        self._stream = None
        self._state: RequestState | None = None
        self._budget: int | None = None
        self._parsers: list[OutputParsers] = []
        self._seq: SequenceState | None = None  # the last leg's final state (`deltas`)
        self.leg_ends: list[tuple[str | None, int | str | None]] = []   # each leg's (finish, stop reason)
        self._num_output_tokens = 0
        self._num_cached_tokens = 0

    # -- prepare ------------------------------------------------------------------------------

    @classmethod
    def render(cls, ctx: ServerContext, request: TurnRequest) -> ChatTurn:
        """The prompt's text and token ids (call off the event loop: long chats take a while)."""
        text = render_chat(ctx.chat_template, request.messages, tools=request.tool_use.tools,
                           add_generation_prompt=request.add_generation_prompt,
                           chat_template_kwargs=request.template_kwargs)
        return cls(ctx, request, text, ctx.engine.encode(text))

    @classmethod
    async def prepare(cls, ctx: ServerContext, request: TurnRequest) -> ChatTurn:
        """`render` off the event loop, then the media: fetched, decoded and expanded into their
        placeholder spans (counted in the prompt's tokens)."""
        turn = await ctx.engine.off_loop(cls.render, ctx, request)
        await turn.add_media()
        return turn

    async def add_media(self) -> None:
        if self.ctx.media is not None:
            self.token_ids, self.mm_inputs = await self.ctx.media.prepare(
                self.request.messages, self.token_ids, self.request.mm_processor_kwargs)

    @property
    def thinking_mode(self) -> str | None:
        return self.request.thinking_mode

    def resolve_max_tokens(self, max_tokens: int | None, field_name: str = "max_tokens") -> int | None:
        """The request's max_tokens within the context (`field_name`: the dialect's name of it)."""
        self._max_tokens = self.ctx.engine.resolve_max_tokens(len(self.token_ids), max_tokens, field_name)
        return self._max_tokens

    def sampling_params(self, fields: dict, max_tokens: int | None) -> SamplingParams:
        """`fields` (SamplingParams keywords, None = unset) with the server's sampling defaults."""
        self._fields = dict(fields)
        return build_sampling_params(fields, max_tokens, self.ctx.engine.sampling_defaults)

    def constrain_tools(self, params: SamplingParams, thinking_mode: str | None = None) -> SamplingParams:
        """A forced tool call's grammar replaces any other output constraint (as in vLLM)."""
        grammar = self.request.tool_use.grammar(thinking_mode if thinking_mode is not None else self.thinking_mode)
        if grammar is not None:
            params.structured_outputs = grammar
        return params

    def new_parsers(self, open_arguments: bool = False) -> OutputParsers:
        """The parsers of one output of this turn."""
        tools = self.request.tool_use
        return OutputParsers(self.request.reasoning_parser, self.thinking_mode, tools.parser, tools.tools,
                             tools.tool_choice, open_arguments)

    # -- run ----------------------------------------------------------------------------------

    async def start(self, request_id: str, params: SamplingParams, arrival_time: float,
                    cache_salt: str | None = None, kv_transfer=None, thinking_budget: int | None = None,
                    open_arguments: bool = False) -> None:
        """Submit the turn (its first leg with a `thinking_budget`: then `params` is the
        answer's, and n must be 1); the engine's refusal raises here, before any response."""
        self.request_id, self.arrival, self._budget = request_id, arrival_time, thinking_budget
        if thinking_budget is not None:
            first = dict(self._fields, stop=list(self._fields.get("stop") or []) + [THINK_CLOSE],
                         structured_outputs=None)
            params = build_sampling_params(first, min(thinking_budget, self._max_tokens),
                                           self.ctx.engine.sampling_defaults)
        stream = self.ctx.engine.generate(request_id, self.prompt, self.token_ids, params, arrival_time,
                                          cache_salt, kv_transfer, mm_inputs=self.mm_inputs)
        [self._stream] = await admit([stream])
        if thinking_budget is None:
            self.mm_inputs = None           # no second leg: the engine has the pixels
        self._parsers = [self.new_parsers(open_arguments) for _ in range(params.n)]

    @property
    def parsers(self) -> list[OutputParsers]:
        """Each choice's parsers (after `start`)."""
        return self._parsers

    @property
    def stream(self):
        """The admitted engine stream (async iterator of RequestState), for a dialect that
        collects it whole."""
        return self._stream

    async def steps(self, stream_interval: int = 1) -> AsyncIterator[TurnStep]:
        """Each choice's steps as engine updates arrive. A step waits for `stream_interval`
        new tokens of its choice (--stream-interval), except the last; 0: a step per update."""
        sent_tokens = [0] * len(self._parsers)
        done = [False] * len(self._parsers)
        async for _, state in merge([self._stream]):
            self._state = state
            for seq in state.sequences:
                if done[seq.index]:
                    continue
                start, end = sent_tokens[seq.index], len(seq.token_ids)
                if not seq.finished and end - start < stream_interval:
                    continue
                deltas = self._parsers[seq.index].step(seq.text_delta(), seq.finished)
                if not deltas and start == end and not seq.finished:
                    continue
                sent_tokens[seq.index] = end
                done[seq.index] = seq.finished
                yield TurnStep(seq.index, seq, start, end, deltas, seq.finished)

    @property
    def state(self) -> RequestState | None:
        """The request's latest state (of `steps`)."""
        return self._state

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """One sequence's deltas, leg after leg: per output text, then the end of the output.
        Afterwards `leg_ends` (the last one ends the turn) and `usage()` describe the whole."""
        [parsers] = self._parsers
        async with aclosing(self._texts()) as texts:
            async for text in texts:
                yield parsers.step(text)
        yield parsers.step("", finished=True)

    async def _leg(self, stream, first: bool = False) -> AsyncIterator[str]:
        seq = None
        async with aclosing(stream) as states:
            async for state in states:
                seq = state.sequences[0]
                if first:           # the prefix-cache hit is known from the first output on
                    self._num_cached_tokens = seq.num_cached_tokens
                delta = seq.text_delta()
                if delta:
                    yield delta
        self._seq = seq

    async def _texts(self) -> AsyncIterator[str]:
        """The text the parsers read: the model's output, plus the `</mm:think>` the server
        writes when it closes the thinking block."""
        async for text in self._leg(self._stream, first=True):
            yield text
        first = self._seq
        self._num_output_tokens = len(first.token_ids)
        self.leg_ends.append((first.finish_reason, first.stop_reason))
        if self._budget is None:
            return
        closed = first.stop_reason == THINK_CLOSE
        out_of_budget = first.finish_reason == "length" and len(first.token_ids) < self._max_tokens
        if not (closed or out_of_budget):
            return                      # the end of the output (eos, a stop sequence, max_tokens)
        written = "\n" if closed else _CLOSE_THINKING
        yield THINK_CLOSE + "\n"        # for the parsers: the thinking ends here
        # the model's tokens (a closing tag it wrote ends them) and what the server wrote
        ids = (self.token_ids + first.token_ids
               + self.ctx.engine.tokenizer.encode(written, add_special_tokens=False).ids)
        remaining = min(self._max_tokens - len(first.token_ids), self.ctx.engine.max_total_tokens - len(ids))
        if remaining < 1:
            self.leg_ends.append(("length", None))     # no room left for an answer
            return
        params = build_sampling_params(dict(self._fields, structured_outputs=None), remaining,
                                       self.ctx.engine.sampling_defaults)
        self.constrain_tools(params, "disabled")
        stream = self.ctx.engine.generate(self.request_id + "-answer", None, ids, params, self.arrival,
                                          mm_inputs=self.mm_inputs)
        [stream] = await admit([stream])
        async for text in self._leg(stream):
            yield text
        self._num_output_tokens += len(self._seq.token_ids)
        self.leg_ends.append((self._seq.finish_reason, self._seq.stop_reason))

    def usage(self) -> TurnUsage:
        """Of `deltas`' sequence, so far; the prompt counts the first leg's tokens."""
        return TurnUsage(len(self.token_ids), self._num_output_tokens, self._num_cached_tokens)
