"""The tool-call grammar of tool_choice "required"/named: it admits exactly what the chat
template renders for valid calls (so the model's own format), and refuses content instead of a
call, another tool than the named one, values of the wrong type and missing required arguments."""
import json
from pathlib import Path

import pytest

import m3serve.model
from m3serve.serving.chat_template import render_chat
from m3serve.serving.tool_grammar import tool_call_grammar
from m3serve.serving.tool_parser import NAMESPACE as NS
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
