"""One sequence's output text -> typed deltas: the reasoning parser first, then the tool-call
parser over the content it leaves, the pipeline every API dialect reads the model through.

`OutputParsers.step(text, finished)` is the streaming form (a list of `ReasoningDelta`,
`TextDelta`, `ToolCallDelta` and, when asked for, `ToolArgumentsDelta`, in output order);
`whole(text)` the non-streaming one; `combine` folds a step into one delta. Dialects turn the
deltas into their own events.
"""
from __future__ import annotations

from dataclasses import dataclass

from m3serve.serving.reasoning import get_reasoning_parser
from m3serve.serving.tool_parser import get_tool_parser


@dataclass(frozen=True)
class ReasoningDelta:
    """Text of the thinking block."""

    text: str


@dataclass(frozen=True)
class TextDelta:
    """Visible answer text (never empty)."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One tool parser call delta, OpenAI-shaped: `{"index", "id", "type", "function": {"name",
    "arguments": ""}}` when a call opens, `{"index", "function": {"arguments": <JSON text>}}`
    when it closes with its complete arguments."""

    call: dict

    @property
    def index(self) -> int:
        return self.call["index"]


@dataclass(frozen=True)
class ToolArgumentsDelta:
    """The arguments completed so far of the call still open (`index`), parsed: lets a dialect
    stream each argument as it completes."""

    index: int
    arguments: dict


Delta = ReasoningDelta | TextDelta | ToolCallDelta | ToolArgumentsDelta


@dataclass(frozen=True)
class WholeOutput:
    """A finished output, split: reasoning and content (None when empty) and the tool calls
    (`{"id", "type": "function", "function": {"name", "arguments"}}`)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict]


@dataclass(frozen=True)
class Combined:
    """A step's deltas as one chat delta: reasoning, content (None when empty) and call deltas."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict]


def combine(deltas: list[Delta]) -> Combined:
    """One step's deltas as a single delta (the OpenAI dialects send a step as one chunk)."""
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    content = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    return Combined(reasoning or None, content or None, [d.call for d in deltas if isinstance(d, ToolCallDelta)])


class OutputParsers:
    """The parsers of one output. `reasoning_parser` None: no reasoning split (all text is
    content); `tool_parser` None: no tool-call parsing. `open_arguments`: `step` also reports
    the open call's arguments so far (a `ToolArgumentsDelta` after each step's deltas)."""

    def __init__(self, reasoning_parser: str | None, thinking_mode: str | None, tool_parser: str | None,
                 tools: list[dict] | None, tool_choice, open_arguments: bool = False):
        self.reasoning = get_reasoning_parser(reasoning_parser)(thinking_mode) if reasoning_parser else None
        self.tools = get_tool_parser(tool_parser)(tools, tool_choice) if tool_parser else None
        self.open_arguments = open_arguments

    @property
    def has_tool_calls(self) -> bool:
        """Whether a call has been opened so far (streaming)."""
        return self.tools is not None and self.tools.has_tool_calls

    def step(self, text: str, finished: bool = False) -> list[Delta]:
        """The deltas of `text`, the next piece of the output; `finished` ends the output
        (what the parsers held back comes out)."""
        reasoning, content = self.reasoning.stream(text) if self.reasoning else (None, text)
        if finished and self.reasoning:
            tail_reasoning, tail_content = self.reasoning.finish()
            reasoning = (reasoning or "") + (tail_reasoning or "")
            content = (content or "") + (tail_content or "")
        out: list[Delta] = [ReasoningDelta(reasoning)] if reasoning else []
        if self.tools is None:
            if content:
                out.append(TextDelta(content))
            return out
        pieces = [self.tools.stream(content or "")]
        if finished:
            pieces.append(self.tools.finish())
        for piece in pieces:
            if piece.content:
                out.append(TextDelta(piece.content))
            out.extend(ToolCallDelta(call) for call in piece.tool_call_deltas)
        if self.open_arguments and not finished:
            opened = self.tools.open_call_arguments()
            if opened is not None:
                out.append(ToolArgumentsDelta(*opened))
        return out

    def whole(self, text: str) -> WholeOutput:
        """The split of a whole output (leaves the streaming state untouched)."""
        reasoning, content = self.reasoning.extract(text) if self.reasoning else (None, text)
        if self.tools is None:
            return WholeOutput(reasoning, content, [])
        result = self.tools.extract(content or "")
        return WholeOutput(reasoning, result.content, result.tool_calls)
