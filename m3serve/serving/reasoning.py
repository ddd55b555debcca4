"""Reasoning parsers: split a model's output into reasoning (the thinking block) and content.

Owns the `minimax_m3` parser (docs/model.md §7: `<mm:think>…</mm:think>` matched as text, in streaming
and non-streaming form) and the name -> parser registry behind `--reasoning-parser`.
"""
from __future__ import annotations

from m3serve.model.markup import THINK_CLOSE, THINK_OPEN

THINKING_MODES = ("enabled", "disabled", "adaptive")

# Streaming states of MiniMaxM3ReasoningParser.
_START = "start"  # nothing decided yet: a stray closer (or a repeated opener) may still come
_SEEK_OPEN = "seek_open"  # content; an opener would start reasoning
_REASONING = "reasoning"  # inside the thinking block; a closer ends it
_CONTENT = "content"  # the rest of the output is content, markers included


def partial_suffix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (0 if none)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class MiniMaxM3ReasoningParser:
    """Splits MiniMax-M3 output into (reasoning, content) following the split rules of docs/model.md §7.

    `thinking_mode` is the request's chat-template kwarg (None when unset). With "enabled" the
    template prefilled `<mm:think>`, so the output starts inside the thinking block:

    1. enabled: text before the first `</mm:think>` is reasoning, the rest is content; no closer
       means everything is reasoning. A repeated opener at the very start is dropped.
    2. otherwise, an output starting with a stray `</mm:think>` drops it; the rest is content.
    3. otherwise, text between the first `<mm:think>` and the next `</mm:think>` is reasoning;
       text before the opener plus text after the closer is content; no closer -> the tail is
       reasoning.
    4. no markers: everything is content.

    Rule 1 is read causally: in enabled mode an opener later in the output stays literal text
    (docs/model.md's "no `<mm:think>` in the output" cannot be known while streaming reasoning that
    was already sent). Markers after the split point are ordinary text. Empty parts are None.

    One instance parses one output: `extract` for a whole text, or `stream` per delta followed
    by `finish`. Streaming holds back a tail that may still become a marker, so the streamed
    deltas concatenate to exactly `extract(full_text)` whatever the chunk boundaries.
    """

    def __init__(self, thinking_mode: str | None = None):
        if thinking_mode is not None and thinking_mode not in THINKING_MODES:
            raise ValueError(f"thinking_mode must be one of {list(THINKING_MODES)} or None, got {thinking_mode!r}")
        self.thinking_mode = thinking_mode
        self._starts_in_reasoning = thinking_mode == "enabled"
        self._state = _START
        self._pending = ""  # received text not yet assigned to reasoning or content
        self._finished = False

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """Whole-output split: returns (reasoning, content), each None when empty."""
        if self._starts_in_reasoning:
            if text.startswith(THINK_OPEN):
                text = text[len(THINK_OPEN):]
            reasoning, _, content = text.partition(THINK_CLOSE)
            return reasoning or None, content or None
        if text.startswith(THINK_CLOSE):
            return None, text[len(THINK_CLOSE):] or None
        before, opener, after = text.partition(THINK_OPEN)
        if not opener:
            return None, text or None
        reasoning, _, after_close = after.partition(THINK_CLOSE)
        return reasoning or None, (before + after_close) or None

    def stream(self, delta_text: str) -> tuple[str | None, str | None]:
        """Feeds one text delta; returns the (reasoning_delta, content_delta) now safe to send."""
        if self._finished:
            raise ValueError("stream() called after finish(); use a new parser per output")
        self._pending += delta_text
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content):
            pass
        return "".join(reasoning) or None, "".join(content) or None

    def finish(self) -> tuple[str | None, str | None]:
        """Ends the output: flushes a held-back partial marker as ordinary text."""
        self._finished = True
        tail, self._pending = self._pending, ""
        if not tail:
            return None, None
        if self._state == _REASONING or (self._state == _START and self._starts_in_reasoning):
            return tail, None
        return None, tail

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Advances the state machine once; returns False when it must wait for more text."""
        text = self._pending
        if self._state == _START:
            marker = THINK_OPEN if self._starts_in_reasoning else THINK_CLOSE
            if text.startswith(marker):
                self._pending = text[len(marker):]
                self._state = _REASONING if self._starts_in_reasoning else _CONTENT
                return True
            if marker.startswith(text):
                return False
            self._state = _REASONING if self._starts_in_reasoning else _SEEK_OPEN
            return True
        if self._state == _CONTENT:
            content.append(text)
            self._pending = ""
            return False
        marker, sink, next_state = (
            (THINK_OPEN, content, _REASONING) if self._state == _SEEK_OPEN else (THINK_CLOSE, reasoning, _CONTENT)
        )
        index = text.find(marker)
        if index >= 0:
            sink.append(text[:index])
            self._pending = text[index + len(marker):]
            self._state = next_state
            return True
        safe = len(text) - partial_suffix_len(text, marker)
        sink.append(text[:safe])
        self._pending = text[safe:]
        return False


_REASONING_PARSERS = {"minimax_m3": MiniMaxM3ReasoningParser}


def get_reasoning_parser(name: str) -> type[MiniMaxM3ReasoningParser]:
    """Returns the parser class registered as `name` (the `--reasoning-parser` value)."""
    if name not in _REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not known; known parsers: {sorted(_REASONING_PARSERS)}")
    return _REASONING_PARSERS[name]
