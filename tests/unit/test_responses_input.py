"""Responses input items as chat messages (one assistant turn per reasoning + message +
function_call run), and the signed reasoning blob (servers sharing a key read each other's)."""
import pytest

from m3serve.serving.errors import APIError
from m3serve.serving.openai.responses_input import input_messages
from m3serve.serving.signing import ReasoningSigner


def test_items_form_assistant_turns():
    signer = ReasoningSigner("k")
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
             {"type": "reasoning", "summary": [], "encrypted_content": signer.sign("think 1")},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": ""},
             {"type": "function_call_output", "call_id": "c2", "output": "two"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think 2"}]},
             {"type": "message", "role": "assistant", "content": "done"}]
    messages = input_messages(items, [], signer)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[0]["content"] == "ab"
    turn = messages[1]
    assert turn["reasoning_content"] == "think 1" and turn["content"] == "calling"
    assert [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"]
    assert turn["tool_calls"][0]["function"]["arguments"] == {"x": 1} and turn["tool_calls"][1]["function"]["arguments"] == {}
    assert messages[2] == {"role": "tool", "tool_call_id": "c2", "content": "two"}
    assert messages[4]["reasoning_content"] == "think 2" and messages[4]["content"] == "done"


def test_signing_key_is_shared_or_refused():
    blob = ReasoningSigner("same key").sign("private thoughts")
    assert ReasoningSigner("same key").open(blob) == "private thoughts"
    item = {"type": "reasoning", "summary": [], "encrypted_content": blob}
    for other in (ReasoningSigner("another key"), ReasoningSigner()):
        assert other.open(blob) is None and other.open(blob[:-2]) is None and other.open("x") is None
        with pytest.raises(APIError) as e:
            input_messages([{"role": "user", "content": "hi"}] * 3 + [item], [], other)
        assert e.value.status == 400 and e.value.param == "input[3].encrypted_content"
