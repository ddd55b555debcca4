"""Incremental detokenization and stop-string matching for streamed outputs.

`IncrementalDetokenizer` turns token ids into text deltas without ever emitting half of a
multi-byte UTF-8 character; `find_stop` / `stop_holdback` locate stop strings in the growing
output and say how much of its tail must wait because it may still become one.
"""
from __future__ import annotations

from tokenizers import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Tokens of prompt context decoded with the first output tokens; byte-level BPE needs none for
# correctness, but a few keep the window at a character boundary for other decoders too.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decodes one request's output token ids into text, a delta at a time.

    Keeps two offsets into the token list: text up to `_read_offset` has been emitted, and
    decoding restarts from `_prefix_offset` (an earlier character boundary) so the new tokens are
    decoded with their left context. A decoded tail ending in U+FFFD is an incomplete character
    and is held back until more tokens complete it (or `finish()` flushes it). The concatenation
    of all deltas plus `finish()` equals `tokenizer.decode(output_ids)`.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids or [])[-_PROMPT_CONTEXT_TOKENS:]
        if tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT_CHAR):
            context = []  # the prompt ends mid-character: its tail is no clean boundary to decode from
        self._num_context = len(context)
        self._token_ids: list[int] = context  # prompt context followed by output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_context:]

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Appends newly sampled ids; returns the text they complete (possibly "")."""
        self._token_ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or the tail is a partial UTF-8 character
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Flushes text still held back at the end of the request (an unfinished character)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._token_ids))
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self._token_ids)
        self.text += delta
        return delta


def find_stop(text: str, stop: list[str], start: int) -> int | None:
    """Index in text where the earliest stop string begins, or None.

    Only matches that end at or after `start` (the length of text already checked) are looked
    for, so the search begins at `start - max(len(s)) + 1`. The caller truncates text at the
    returned index, excluding the stop string.
    """
    if not stop:
        return None
    search_from = max(0, start - max(len(s) for s in stop) + 1)
    found = [i for i in (text.find(s, search_from) for s in stop if s) if i >= 0]
    return min(found) if found else None


def stop_holdback(text: str, stop: list[str]) -> int:
    """How many trailing characters of text could still be the start of a stop string.

    That many characters must not be streamed yet: the next tokens may complete the stop string,
    which is then cut from the output.
    """
    longest = 0
    for s in stop:
        for length in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:length]):
                longest = length
                break
    return longest
