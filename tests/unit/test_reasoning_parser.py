"""minimax_m3 reasoning parser: docs/model.md §7 split rules, streamed at every chunk boundary."""
import itertools

import pytest

from m3serve.serving.reasoning import MiniMaxM3ReasoningParser, get_reasoning_parser

OPEN, CLOSE = "<mm:think>", "</mm:think>"
NOT_ENABLED = [None, "disabled", "adaptive"]

# (text, expected (reasoning, content)) with the prompt's <mm:think> prefilled (enabled).
ENABLED_CASES = [
    ("abc</mm:think>xyz", ("abc", "xyz")),
    ("\nstep 1\n</mm:think>\nAnswer", ("\nstep 1\n", "\nAnswer")),
    ("still thinking", ("still thinking", None)),
    ("<mm:think>abc</mm:think>xyz", ("abc", "xyz")),  # the model repeated the prefilled opener
    ("</mm:think>xyz", (None, "xyz")),
    ("a</mm:think>b</mm:think>c", ("a", "b</mm:think>c")),
    ("abc</mm:th", ("abc</mm:th", None)),  # cut off mid-closer: stays reasoning text
    ("<mm:th", ("<mm:th", None)),
    ("r<mm:think>s</mm:think>c", ("r<mm:think>s", "c")),  # later opener is literal text
    ("", (None, None)),
]

# The same expectations hold for disabled, adaptive and unset thinking_mode.
OTHER_CASES = [
    ("<mm:think>r</mm:think>c", ("r", "c")),
    ("<mm:think>\nthinking\n</mm:think>\nHello", ("\nthinking\n", "\nHello")),
    ("pre<mm:think>r</mm:think>post", ("r", "prepost")),
    ("</mm:think>c", (None, "c")),  # stray closer dropped
    ("</mm:think>a<mm:think>b</mm:think>c", (None, "a<mm:think>b</mm:think>c")),
    ("plain answer", (None, "plain answer")),
    ("<mm:think>unfinished", ("unfinished", None)),
    ("pre<mm:think>unfinished</mm:th", ("unfinished</mm:th", "pre")),
    ("answer <mm:th", (None, "answer <mm:th")),
    ("</mm:thin", (None, "</mm:thin")),
    ("<", (None, "<")),
    ("a</mm:think>b", (None, "a</mm:think>b")),  # a closer not at the start is text
    ("<mm:think></mm:think>", (None, None)),
    ("<mm:think>r</mm:think>c<mm:think>x</mm:think>", ("r", "c<mm:think>x</mm:think>")),
    ("", (None, None)),
]

ALL_CASES = [("enabled", text, want) for text, want in ENABLED_CASES] + [
    (mode, text, want) for mode in NOT_ENABLED for text, want in OTHER_CASES
]


def chunkings(text: str):
    """Whole text, every two-chunk split, every three-chunk split, and char by char."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, len(text)), 2):
        yield [text[:i], text[i:j], text[j:]]
    yield list(text)


def stream(mode, chunks):
    parser = MiniMaxM3ReasoningParser(mode)
    reasoning, content = [], []
    for chunk in chunks + [None]:
        r, c = parser.finish() if chunk is None else parser.stream(chunk)
        assert r != "" and c != ""  # empty deltas are reported as None
        reasoning.append(r or "")
        content.append(c or "")
    return "".join(reasoning) or None, "".join(content) or None


@pytest.mark.parametrize("mode,text,want", ALL_CASES)
def test_extract_matches_spec(mode, text, want):
    assert MiniMaxM3ReasoningParser(mode).extract(text) == want


@pytest.mark.parametrize("mode,text,want", ALL_CASES)
def test_stream_equals_extract_at_every_boundary(mode, text, want):
    for chunks in chunkings(text):
        assert stream(mode, chunks) == want, chunks


@pytest.mark.parametrize("mode", NOT_ENABLED)
def test_partial_markers_are_held_until_they_resolve(mode):
    parser = MiniMaxM3ReasoningParser(mode)
    assert parser.stream("ans") == (None, "ans")
    assert parser.stream("<mm:th") == (None, None)  # may become the opener
    assert parser.stream("ink>why</mm") == ("why", None)
    assert parser.stream(":think>") == (None, None)
    assert parser.stream("done") == (None, "done")
    assert parser.finish() == (None, None)


@pytest.mark.parametrize("mode", NOT_ENABLED)
def test_stray_closer_prefix_is_held_then_released(mode):
    parser = MiniMaxM3ReasoningParser(mode)
    assert parser.stream("</mm:") == (None, None)
    assert parser.stream("x") == (None, "</mm:x")


def test_enabled_streams_reasoning_immediately_and_flushes_partial_closer():
    parser = MiniMaxM3ReasoningParser("enabled")
    assert parser.stream("think") == ("think", None)
    assert parser.stream("ing</mm:thi") == ("ing", None)
    assert parser.finish() == ("</mm:thi", None)


def test_marker_text_never_reaches_either_channel_char_by_char():
    text = "<mm:think>reason</mm:think>answer"
    parser = MiniMaxM3ReasoningParser(None)
    for char in text:
        r, c = parser.stream(char)
        for piece in (r, c):
            assert piece is None or not set(piece) & set("<>/:")


def test_bad_thinking_mode_and_stream_after_finish_raise():
    with pytest.raises(ValueError, match="thinking_mode.*'on'"):
        MiniMaxM3ReasoningParser("on")
    parser = MiniMaxM3ReasoningParser()
    parser.finish()
    with pytest.raises(ValueError, match="finish"):
        parser.stream("x")


def test_registry():
    assert get_reasoning_parser("minimax_m3") is MiniMaxM3ReasoningParser
    with pytest.raises(ValueError, match="minimax_m3"):
        get_reasoning_parser("deepseek_r1")
