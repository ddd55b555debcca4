"""The tool-call grammar of tool_choice "required"/named: it admits exactly what the chat
template renders for valid calls (so the model's own format), and refuses content instead of a
call, another tool than the named one, values of the wrong type and missing required arguments."""
import json
from pathlib import Path

import pytest

import m3serve.model
from m3serve.serving.chat_template import render_chat
from m3serve.structured.tool_grammar import tool_call_grammar
from m3serve.model.markup import NAMESPACE as NS
from m3serve.serving.tool_parser import MiniMaxM3ToolParser

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "unit": {"enum": ["C", "F"]},
        "ratio": {"type": ["number", "null"]},
        "opts": {"type": "object", "properties": {"exact": {"type": "boolean"}, "n": {"const": 3}}},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "extra": {"type": "object"}}}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, NOARGS]

CALL = {"city": "Par]<]is\n", "days": 3, "unit": "C", "ratio": -0.5, "opts": {"exact": True, "n": 3},
        "tags": ["a", "b c"], "extra": {"k": {"deep": "v"}}}


def rendered(*calls):
    """What the chat template writes for an assistant turn with these calls (after the prompt)."""
    template = (Path(m3serve.model.__file__).parent / "chat_template.jinja").read_text()
    messages = [{"role": "user", "content": "hi"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    whole = render_chat(template, messages + [turn], tools=TOOLS, add_generation_prompt=False,
                        chat_template_kwargs={"thinking_mode": "disabled"})
    start = whole.rindex(NS + "<tool_call>")          # the tools section shows an example block first
    return whole[start:whole.rindex(NS + "</tool_call>") + len(NS + "</tool_call>")]


def accepts(text, choice="required", mode="disabled"):
    grammar = xgr.Grammar.from_ebnf(tool_call_grammar(TOOLS, choice, mode))
    return _is_grammar_accept_string(grammar, text)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_template_rendering_of_valid_calls_is_admitted_and_parses_back():
    text = rendered(("get_weather", CALL), ("ping", {}))
    assert accepts(text)
    assert accepts(rendered(("get_weather", {"city": "Rome", "days": 1})), NAMED)
    calls = MiniMaxM3ToolParser(TOOLS, "required").extract(text).tool_calls
    import json
    assert [c["function"]["name"] for c in calls] == ["get_weather", "ping"]
    assert json.loads(calls[0]["function"]["arguments"]) == CALL


@pytest.mark.parametrize("mode,prefix,ok", [
    ("enabled", "plan: call it\n</mm:think>\n", True),
    ("enabled", "", False),                               # the open reasoning block must close first
    ("adaptive", "<mm:think>\nhm\n</mm:think>\n", True),
    ("adaptive", "", True),
    ("disabled", "<mm:think>\nhm\n</mm:think>\n", False),
    ("disabled", "Sure, let me check. ", False),          # content instead of (or before) a call
    ("adaptive", "Sure. ", False),
])
def test_reasoning_by_thinking_mode_and_no_content(mode, prefix, ok):
    assert accepts(prefix + rendered(("ping", {})), mode=mode) is ok


@pytest.mark.parametrize("call", [
    {"city": "Rome"},                                     # required argument missing
    {"city": "Rome", "days": "three"},                    # not an integer
    {"city": "Rome", "days": 1, "unit": "K"},             # outside the enum
    {"city": "Rome", "days": 1, "opts": {"exact": "yes"}},
    {"city": "Rome", "days": 1, "opts": {"n": 4}},        # not the const
    {"city": "Rome", "days": 1, "tags": []},              # minItems 1
    {"city": "Rome", "days": 1, "colour": "red"},         # not in the schema
])
def test_wrong_arguments_are_refused(call):
    assert not accepts(rendered(("get_weather", call)))


def test_named_choice_admits_only_one_call_of_that_tool():
    one = rendered(("get_weather", {"city": "Rome", "days": 1}))
    assert accepts(one, NAMED)
    assert not accepts(rendered(("ping", {})), NAMED)
    assert not accepts(rendered(("get_weather", {"city": "Rome", "days": 1}), ("get_weather", {"city": "X", "days": 2})),
                       NAMED)
    assert not accepts("", NAMED) and not accepts("")


def _integer_grammar(schema, choice=None):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["n"], "properties": {"n": schema}}}}
    return xgr.Grammar.from_ebnf(tool_call_grammar([tool], choice or "required", "disabled"))


def _call_n(text):
    return f"{NS}<tool_call>\n{NS}<invoke name=\"f\">\n{NS}<n>{text}{NS}</n>\n{NS}</invoke>\n{NS}</tool_call>"


@pytest.mark.parametrize("schema,ok,refused", [
    # no bounds: the 64-bit range (what clients can send back), not any number of digits
    ({"type": "integer"}, ["0", "-7", str(2**63 - 1), str(-2**63), "1" * 18],
     [str(2**63), str(-2**63 - 1), "1" * 80, "007", "-0"]),
    ({"type": "integer", "minimum": 1, "maximum": 10}, ["1", "5", "10"], ["0", "11", "-1", "100"]),
    ({"type": "integer", "minimum": -3}, ["-3", "0", "999"], ["-4", "-10", "-30"]),
    ({"type": "integer", "maximum": -20}, ["-20", "-21", "-99999"], ["-19", "0", "20"]),
    ({"type": "integer", "minimum": 17, "maximum": 2034}, ["17", "99", "100", "999", "2034", "1999"],
     ["16", "9", "2035", "2100", "3000", "10000"]),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}, ["1", "4"], ["0", "5"]),
    ({"type": "integer", "minimum": 0.5, "maximum": 2.5}, ["1", "2"], ["0", "3"]),
    ({"type": "integer", "minimum": 0, "maximum": 10**30}, ["0", str(2**63 - 1)], ["-1", str(2**63)]),
    ({"type": ["integer", "null"], "maximum": 3}, ["3", "null"], ["4"]),
])
def test_integers_keep_their_bounds_and_64_bits(schema, ok, refused):
    grammar = _integer_grammar(schema)
    for text in ok:
        assert _is_grammar_accept_string(grammar, _call_n(text)), text
    for text in refused:
        assert not _is_grammar_accept_string(grammar, _call_n(text)), text


def test_numbers_have_bounded_digits():
    grammar = _integer_grammar({"type": "number"})
    for text in ("0", "-1.5", "3.25e10", "1" * 18, "12.5E-3"):
        assert _is_grammar_accept_string(grammar, _call_n(text)), text
    for text in ("1" * 80, "1e999", "1." + "5" * 80):
        assert not _is_grammar_accept_string(grammar, _call_n(text)), text


def test_integer_bounds_no_integer_meets_are_a_named_error():
    with pytest.raises(ValueError, match=r"f\.n: no integer is >= 5 and <= 3"):
        _integer_grammar({"type": "integer", "minimum": 5, "maximum": 3})


def test_draft4_exclusive_bounds():
    grammar = _integer_grammar({"type": "integer", "minimum": 0, "exclusiveMinimum": True,
                                "maximum": 3, "exclusiveMaximum": True})
    assert [t for t in ("0", "1", "2", "3") if _is_grammar_accept_string(grammar, _call_n(t))] == ["1", "2"]
