"""The model's text → Anthropic content blocks, as stream events and as the final `content` list.

One `BlockBuilder` per response. It turns the typed deltas of the turn's `OutputParsers` (M3's
reasoning parser, then the tool-call parser on the content) into `content_block_start` / `content_block_delta` /
`content_block_stop` events: `thinking` blocks (closed with a `signature_delta` whose signature
carries the thinking text, signed, so a client that sends the block back -- with its text, or
emptied, as `thinking.display: "omitted"` asks -- gives the next turn the same thinking), `text` blocks
(whitespace at a block's ends dropped, so no whitespace-only text block is ever sent) and
`tool_use` blocks whose input is streamed as `input_json_delta` pieces, one per argument as the
parser completes it. Streaming and non-streaming responses are built from the same events, so
they carry the same blocks.
"""
from __future__ import annotations

import json
import uuid

from m3serve.serving.output_parsers import (Delta, OutputParsers, ReasoningDelta, TextDelta, ToolArgumentsDelta,
                                            ToolCallDelta)
from m3serve.serving.signing import ReasoningSigner


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class BlockBuilder:
    """Takes one output's deltas in (`add`; or its text, `feed`, through `parsers`), hands
    Anthropic events out, and keeps the finished `content` list and whether a tool was called.
    `parsers` should report open calls' arguments (`open_arguments`), streamed as they complete."""

    def __init__(self, parsers: OutputParsers, signer: ReasoningSigner | None = None, show_thinking: bool = True):
        self.parsers = parsers
        self.signer = signer or ReasoningSigner()
        self.show_thinking = show_thinking      # False: thinking blocks go out empty (display "omitted")
        self._thought = ""                      # the open thinking block's text
        self.content: list[dict] = []
        self._open: str | None = None      # "thinking" | "text" | "tool_use"
        self._space = ""                    # whitespace held back at the end of a text block
        self._calls: dict[int, dict] = {}   # tool parser's call index -> our block and what was sent

    @property
    def has_tool_use(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.content)

    def feed(self, text: str, finished: bool = False) -> list[dict]:
        """Events for `text`, the next piece of the output; `finished` ends the output (every
        open block is closed)."""
        return self.add(self.parsers.step(text, finished), finished)

    def add(self, deltas: list[Delta], finished: bool = False) -> list[dict]:
        """Events for the next step's deltas; `finished` ends the output (every open block is
        closed)."""
        events: list[dict] = []
        for delta in deltas:
            if isinstance(delta, ReasoningDelta):
                self._thinking(delta.text, events)
            elif isinstance(delta, TextDelta):
                self._text(delta.text, events)
            elif isinstance(delta, ToolCallDelta):
                self._tool_delta(delta.call, events)
            elif isinstance(delta, ToolArgumentsDelta) and delta.index in self._calls:
                self._send_arguments(self._calls[delta.index], delta.arguments, events)
        if finished:
            self._close(events)
        return events

    def _start(self, block: dict, events: list[dict]) -> None:
        self._close(events)
        self.content.append(block)
        self._open = block["type"]
        events.append({"type": "content_block_start", "index": len(self.content) - 1,
                       "content_block": dict(block)})

    def _delta(self, delta: dict, events: list[dict]) -> None:
        events.append({"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta})

    def _close(self, events: list[dict]) -> None:
        if self._open is None:
            return
        block, index = self.content[-1], len(self.content) - 1
        if self._open == "thinking":
            block["signature"] = self.signer.sign(self._thought)
            self._delta({"type": "signature_delta", "signature": block["signature"]}, events)
        self._open, self._space = None, ""
        events.append({"type": "content_block_stop", "index": index})

    def _thinking(self, text: str, events: list[dict]) -> None:
        if self._open != "thinking":
            self._start({"type": "thinking", "thinking": "", "signature": ""}, events)
            self._thought = ""
        self._thought += text
        if self.show_thinking:
            self.content[-1]["thinking"] += text
            self._delta({"type": "thinking_delta", "thinking": text}, events)

    def _text(self, text: str, events: list[dict]) -> None:
        if self._open != "text":
            text = text.lstrip()
            if not text:
                return
            self._start({"type": "text", "text": ""}, events)
        held = self._space + text
        body = held.rstrip()
        self._space = held[len(body):]
        if body:
            self.content[-1]["text"] += body
            self._delta({"type": "text_delta", "text": body}, events)

    def _tool_delta(self, delta: dict, events: list[dict]) -> None:
        index = delta["index"]
        function = delta.get("function", {})
        if "id" in delta:       # a call opens
            block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": function["name"],
                     "input": {}}
            self._start(block, events)
            self._calls[index] = {"block": block, "sent": {}}
            return
        call = self._calls[index]
        arguments = json.loads(function["arguments"])
        self._send_arguments(call, arguments, events)
        self._delta({"type": "input_json_delta", "partial_json": "}" if call["sent"] else "{}"}, events)
        call["block"]["input"] = arguments
        self._close(events)

    def _send_arguments(self, call: dict, arguments: dict, events: list[dict]) -> None:
        """One `input_json_delta` per argument not sent yet (or whose value changed: a name
        repeated in the markup becomes a list). The pieces concatenate to a JSON object whose
        later duplicate keys carry the final values, which JSON parsers keep."""
        sent = call["sent"]
        for name, value in arguments.items():
            text = _dumps(value)
            if sent.get(name) == text:
                continue
            piece = ("{" if not sent else ", ") + _dumps(name) + ": " + text
            sent[name] = text
            self._delta({"type": "input_json_delta", "partial_json": piece}, events)
