"""Reasoning and tool-call parsing through the server's streaming and non-streaming chat paths,
with the model output forced at the engine boundary (a scripted engine emitting the token ids
of a known text through the real detokenizer, parsers and SSE framing)."""
import json

import httpx
import openai
import pytest

from serverutil import MODEL_NAME, InProcessServer

NS = "]<]minimax[>["
CALL = (f"{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">\n{NS}<city>Paris{NS}</city>\n"
        f"{NS}<days>3{NS}</days>\n{NS}</invoke>\n{NS}</tool_call>")
SCRIPT = f"<mm:think>The user wants weather.</mm:think>Let me check.\n{CALL}"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture()
def scripted(scripted_server):
    def use(script: str, tokens_per_output: int = 1):
        scripted_server.client.script = script
        scripted_server.client.tokens_per_output = tokens_per_output
        return openai.OpenAI(base_url=scripted_server.url + "/v1", api_key="x", max_retries=0)
    return use


def _collect_stream(stream):
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            assert (extra.get("reasoning_content") or "") == (extra.get("reasoning") or "")
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return reasoning, content, calls, finish


def test_reasoning_then_tool_call_non_streaming(scripted):
    client = scripted(SCRIPT)
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=500)
    choice = out.choices[0]
    assert choice.message.model_extra["reasoning_content"] == "The user wants weather."
    assert choice.message.model_extra["reasoning"] == "The user wants weather."
    assert choice.message.content == "Let me check.\n"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}  # typed by the schema
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("tokens_per_output", [1, 3])
def test_streamed_parse_equals_non_streamed(scripted, tokens_per_output):
    client = scripted(SCRIPT, tokens_per_output)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=500,
                                            stream=True, stream_options={"include_usage": True})
    reasoning, content, calls, finish = _collect_stream(stream)
    assert reasoning == "The user wants weather."
    assert content == "Let me check.\n"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    assert finish == "tool_calls"


def test_tool_choice_none_leaves_markup_in_content(scripted):
    client = scripted(f"Sure.{CALL}")
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         max_tokens=500)
    assert out.choices[0].message.content == f"Sure.{CALL}"
    assert not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_thinking_mode_enabled_splits_without_opener(scripted, scripted_server):
    client = scripted("step one</mm:think>The answer.")
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=500,
                                         extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}})
    message = out.choices[0].message
    assert message.model_extra["reasoning_content"] == "step one"
    assert message.content == "The answer."
    prompt = scripted_server.client.tokenizer.decode(scripted_server.client.requests[-1].prompt_token_ids,
                                                     skip_special_tokens=False)
    assert prompt.endswith("<mm:think>\n")  # the template prefilled the opener


def test_default_chat_template_kwargs_apply_and_request_overrides(tiny_dir):
    srv = InProcessServer(tiny_dir, reasoning_parser="minimax_m3",
                          default_chat_template_kwargs={"thinking_mode": "enabled"})
    try:
        srv.client.script = "hmm</mm:think>Yes."
        body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 100}
        default = httpx.post(srv.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert (default["reasoning_content"], default["content"]) == ("hmm", "Yes.")
        srv.client.script = "Plain answer."
        body["chat_template_kwargs"] = {"thinking_mode": "disabled"}
        plain = httpx.post(srv.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert (plain["reasoning_content"], plain["content"]) == (None, "Plain answer.")
        prompt = srv.client.tokenizer.decode(srv.client.requests[-1].prompt_token_ids, skip_special_tokens=False)
        assert prompt.endswith("<mm:think>\n</mm:think>\n")
        # tools without --tool-call-parser: "auto" is refused, as in vLLM
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "tools": TOOLS})
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_stream_stop_string_aborts_in_engine(scripted, scripted_server):
    client = scripted("alpha beta gamma delta")
    before = len(scripted_server.client.aborted)
    stream = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=50, stop=["gamma"], stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == "alpha beta "
    assert len(scripted_server.client.aborted) == before + 1  # the engine is told to stop and free


def _tokens_of(scripted_server, text: str) -> int:
    return len(scripted_server.client.tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_cut_by_max_tokens_leaks_no_markup(scripted, scripted_server, tool_choice):
    """max_tokens inside the call's markup: never markup in content (whole or in any streamed
    delta), finish_reason "length"; a call only once its header is whole, with the arguments
    completed before the cut."""
    client = scripted(CALL)
    header = f"{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">"
    after_city = CALL[:CALL.index("</city>") + len("</city>")]
    opener = _tokens_of(scripted_server, f"{NS}<tool_call>")
    cases = [(n, []) for n in range(1, opener + 1)]
    cases += [(_tokens_of(scripted_server, header) + 1, [{}]), (_tokens_of(scripted_server, after_city) + 1,
                                                                [{"city": "Paris"}])]
    for max_tokens, want in cases:
        kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                      max_tokens=max_tokens, extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}})
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.content is None, (max_tokens, choice.message.content)
        assert [json.loads(c.function.arguments) for c in choice.message.tool_calls or []] == want, max_tokens
        assert choice.finish_reason == "length"
        _, content, calls, finish = _collect_stream(client.chat.completions.create(**kwargs, stream=True))
        assert content == "" and finish == "length", (max_tokens, content)
        assert [json.loads(c["arguments"]) for c in calls.values()] == want


@pytest.mark.parametrize("script, thinking", [("\n\n  " + CALL, "disabled"),
                                              ("I should look it up.</mm:think>\n\n" + CALL, "enabled")])
def test_whitespace_before_a_call_is_null_content(scripted, script, thinking):
    """As vLLM: whitespace alone before the call block is no content, whether the model wrote
    it or it follows an enabled reasoning block."""
    client = scripted(script)
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=500,
                  extra_body={"chat_template_kwargs": {"thinking_mode": thinking}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.content is None and [c.function.name for c in message.tool_calls] == ["get_weather"]
    _, content, calls, finish = _collect_stream(client.chat.completions.create(**kwargs, stream=True))
    assert content == "" and finish == "tool_calls" and calls[0]["name"] == "get_weather"
