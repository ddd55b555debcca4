"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the official
`anthropic` SDK: block parsing, the event sequence and the thinking budget with the model output
forced at the engine boundary (the scripted server), and the real engine on the tiny model
(forced tool_choice through the grammar, max_tokens, prefix-cache usage)."""
import json

import anthropic
import httpx
import pytest

from serverutil import MODEL_NAME

NS = "]<]minimax[>["
CALL = (f"{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">\n{NS}<city>Paris{NS}</city>\n"
        f"{NS}<days>3{NS}</days>\n{NS}</invoke>\n{NS}</tool_call>")
SCRIPT = f"<mm:think>The user wants weather.</mm:think>Let me check.\n{CALL}"
WEATHER = {"name": "get_weather", "description": "Weather forecast", "cache_control": {"type": "ephemeral"},
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "days": {"type": "integer"}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture()
def scripted(scripted_server):
    """An SDK client of the scripted server; `use(*scripts)` sets what the engine emits (one
    script per engine request, the last one repeating)."""
    client = anthropic.Anthropic(base_url=scripted_server.url, api_key="x", max_retries=0)

    def use(*scripts: str, tokens_per_output: int = 1):
        engine = scripted_server.client
        engine.scripts, engine.script = list(scripts[:-1]), scripts[-1]
        engine.tokens_per_output = tokens_per_output
        return client
    yield use
    scripted_server.client.scripts, scripted_server.client.tokens_per_output = [], 1


def prompt_of(engine_request, tokenizer) -> str:
    return tokenizer.decode(engine_request.prompt_token_ids, skip_special_tokens=False)


def test_blocks_non_streaming(scripted, scripted_server):
    out = scripted(SCRIPT).messages.create(model=MODEL_NAME, max_tokens=500, messages=ASK, tools=[WEATHER])
    assert [b.type for b in out.content] == ["thinking", "text", "tool_use"]
    thinking, text, call = out.content
    assert thinking.thinking == "The user wants weather." and thinking.signature
    assert text.text == "Let me check."        # the newline before the tool call is not text
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input == {"city": "Paris", "days": 3}    # an object, typed by the schema
    assert out.stop_reason == "tool_use" and out.stop_sequence is None
    counted = scripted(SCRIPT).messages.count_tokens(model=MODEL_NAME, messages=ASK, tools=[WEATHER])
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == counted.input_tokens
    tokenizer = scripted_server.client.tokenizer
    assert out.usage.output_tokens == len(tokenizer.encode(SCRIPT, add_special_tokens=False).ids)


def _raw_events(url: str, body: dict) -> list[tuple[str, dict]]:
    events = []
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name       # the SSE event name is the data's type
                events.append((name, data))
    return events


@pytest.mark.parametrize("tokens_per_output", [1, 7])
def test_stream_event_sequence(scripted, scripted_server, tokens_per_output):
    scripted(SCRIPT, tokens_per_output=tokens_per_output)
    events = _raw_events(scripted_server.url, {"model": MODEL_NAME, "max_tokens": 500, "messages": ASK,
                                               "tools": [WEATHER], "stream": True})
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    message = events[0][1]["message"]
    assert message["content"] == [] and message["stop_reason"] is None and message["role"] == "assistant"
    blocks: dict[int, dict] = {}
    open_index = None
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None                  # blocks never overlap
            open_index = data["index"]
            assert open_index == len(blocks)           # indices count up from 0
            blocks[open_index] = {**data["content_block"], "deltas": []}
        elif name == "content_block_delta":
            assert data["index"] == open_index
            blocks[open_index]["deltas"].append(data["delta"])
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            assert name == "ping"
    thinking, text, call = blocks[0], blocks[1], blocks[2]
    assert [d["type"] for d in thinking["deltas"]][-1] == "signature_delta"
    assert "".join(d.get("thinking", "") for d in thinking["deltas"]) == "The user wants weather."
    assert {d["type"] for d in text["deltas"]} == {"text_delta"}
    assert "".join(d["text"] for d in text["deltas"]) == "Let me check."
    assert call["type"] == "tool_use" and call["input"] == {} and call["name"] == "get_weather"
    pieces = [d["partial_json"] for d in call["deltas"]]
    assert {d["type"] for d in call["deltas"]} == {"input_json_delta"}
    assert pieces == ['{"city": "Paris"', ', "days": 3', "}"]     # one per argument, then the brace
    assert json.loads("".join(pieces)) == {"city": "Paris", "days": 3}
    final = events[-2][1]
    assert final["delta"]["stop_reason"] == "tool_use" and final["usage"]["output_tokens"] > 0


def test_sdk_stream_matches_non_streaming(scripted):
    client = scripted(SCRIPT, tokens_per_output=3)
    whole = client.messages.create(model=MODEL_NAME, max_tokens=500, messages=ASK, tools=[WEATHER])
    with client.messages.stream(model=MODEL_NAME, max_tokens=500, messages=ASK, tools=[WEATHER]) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert "input_json" in kinds and "thinking" in kinds and "signature" in kinds
    strip = lambda m: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in m.content]  # noqa: E731
    assert strip(streamed) == strip(whole)
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences(scripted):
    client = scripted("Hello there STOP and more")
    out = client.messages.create(model=MODEL_NAME, max_tokens=100, messages=ASK, stop_sequences=["STOP"],
                                 thinking={"type": "disabled"})
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "STOP"
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == "Hello there"
    with client.messages.stream(model=MODEL_NAME, max_tokens=100, messages=ASK, stop_sequences=["STOP"],
                                thinking={"type": "disabled"}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_sequence == "STOP" and streamed.content[0].text == "Hello there"


def test_max_tokens_stop_reason(scripted):
    out = scripted("one two three four five six seven").messages.create(
        model=MODEL_NAME, max_tokens=3, messages=ASK, thinking={"type": "disabled"})
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 3


def test_thinking_budget_closes_the_block(scripted, scripted_server):
    """The first leg stops at the budget; the server closes the thinking block and the answer
    is generated after it, within what is left of max_tokens."""
    engine = scripted_server.client
    client = scripted("a long line of thought that goes on and on and on", "Done.")
    first = len(engine.requests)
    out = client.messages.create(model=MODEL_NAME, max_tokens=50, messages=ASK,
                                 thinking={"type": "enabled", "budget_tokens": 5})
    legs = engine.requests[first:]
    assert len(legs) == 2
    assert legs[0].sampling_params.max_tokens == 5
    tokenizer = engine.tokenizer
    thought_ids = tokenizer.encode("a long line of thought that goes on and on and on",
                                   add_special_tokens=False).ids[:5]
    close_ids = tokenizer.encode("\n</mm:think>\n", add_special_tokens=False).ids
    assert legs[1].prompt_token_ids == legs[0].prompt_token_ids + thought_ids + close_ids
    assert legs[1].sampling_params.max_tokens == 50 - 5
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == tokenizer.decode(thought_ids)
    assert out.content[1].text == "Done." and out.stop_reason == "end_turn"
    assert out.usage.output_tokens == 5 + len(tokenizer.encode("Done.", add_special_tokens=False).ids)


def test_thinking_closed_by_the_model_within_budget(scripted, scripted_server):
    engine = scripted_server.client
    client = scripted("short thought</mm:think>\nignored by the stop", "Answer.")
    first = len(engine.requests)
    with client.messages.stream(model=MODEL_NAME, max_tokens=100, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 40}) as stream:
        out = stream.get_final_message()
    legs = engine.requests[first:]
    assert len(legs) == 2
    tokenizer = engine.tokenizer
    assert prompt_of(legs[1], tokenizer).endswith("<mm:think>\nshort thought</mm:think>\n")
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in out.content] == [
        ("thinking", "short thought"), ("text", "Answer.")]


def test_three_turn_tool_loop_keeps_thinking(scripted, scripted_server):
    """Every turn's prompt holds every earlier turn's thinking, rendered as M3's template
    renders a finished thinking block."""
    engine = scripted_server.client
    messages = list(ASK)
    for turn in range(3):
        client = scripted(f"thought number {turn}</mm:think>", CALL)
        first = len(engine.requests)
        out = client.messages.create(model=MODEL_NAME, max_tokens=300, messages=messages, tools=[WEATHER],
                                     thinking={"type": "enabled", "budget_tokens": 100})
        prompt = prompt_of(engine.requests[first], engine.tokenizer)
        for earlier in range(turn):
            assert f"<mm:think>\nthought number {earlier}\n</mm:think>\n" in prompt
        assert prompt.endswith("]~b]ai\n<mm:think>\n")          # this turn thinks too
        assert out.stop_reason == "tool_use"
        assert [b.type for b in out.content] == ["thinking", "tool_use"]
        assert out.content[0].thinking == f"thought number {turn}"
        call = out.content[1]
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": f"sunny {turn}"}],
             "is_error": turn == 1}]})
    rendered = httpx.post(scripted_server.url + "/v1/messages/render", timeout=30, json={
        "model": MODEL_NAME, "messages": messages, "tools": [WEATHER],
        "thinking": {"type": "enabled", "budget_tokens": 100}}).json()["prompt"]
    assert rendered.count("<mm:think>\nthought number") == 3
    assert "sunny 0" in rendered and "Error: sunny 1" in rendered
    assert f"{NS}<city>Paris{NS}</city>" in rendered          # tool_use input rendered back


def test_tool_loop_takes_back_what_the_server_wrote(scripted, scripted_server):
    """A tool_use input holding an integer past 64 bits (the model wrote it; no schema bound
    stops an unconstrained call) goes back verbatim in the next turn, to create and to
    count_tokens; a tool schema may hold such integers too."""
    big = 10 ** 80
    call = CALL.replace("<days>3", f"<days>{big}")
    tool = {**WEATHER, "input_schema": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "maximum": 10 ** 30}}}}
    client = scripted(call, "Done.")
    out = client.messages.create(model=MODEL_NAME, max_tokens=300, messages=ASK, tools=[tool])
    [use] = [b for b in out.content if b.type == "tool_use"]
    assert use.input == {"city": "Paris", "days": big}
    messages = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "ok"}]}]
    again = client.messages.create(model=MODEL_NAME, max_tokens=300, messages=messages, tools=[tool])
    assert again.content[0].text == "Done."
    assert client.messages.count_tokens(model=MODEL_NAME, messages=messages, tools=[tool]).input_tokens > 0
    r = httpx.post(scripted_server.url + "/v1/messages", timeout=30, json={
        "model": MODEL_NAME, "max_tokens": big, "messages": messages, "tools": [tool]})
    assert r.status_code == 400 and "max_tokens: integer out of the 64-bit range" in r.json()["error"]["message"]


def test_thinking_modes_map_to_the_template(scripted_server):
    def prompt(**extra):
        r = httpx.post(scripted_server.url + "/v1/messages/render", timeout=30,
                       json={"model": MODEL_NAME, "messages": ASK, **extra})
        assert r.status_code == 200, r.text
        return r.json()["prompt"]
    assert prompt(thinking={"type": "enabled", "budget_tokens": 10}).endswith("]~b]ai\n<mm:think>\n")
    assert prompt(thinking={"type": "disabled"}).endswith("]~b]ai\n<mm:think>\n</mm:think>\n")
    assert prompt().endswith("]~b]ai\n")                 # the model's default: adaptive
    assert prompt(thinking={"type": "adaptive"}) == prompt()
    with_system = prompt(system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}])
    assert with_system.startswith("]~!b[]~b]system\nBe brief.[e~[\n")


def test_claude_code_extras_are_accepted(scripted, scripted_server):
    """What Claude Code sends beyond the basics: beta header and query, metadata,
    context_management, cache_control on blocks, 'ctx' roles, redacted thinking."""
    scripted("Fine.")
    r = httpx.post(scripted_server.url + "/v1/messages?beta=true", timeout=30,
                   headers={"anthropic-beta": "interleaved-thinking-2025-05-14,context-management-2025-06-27",
                            "anthropic-version": "2023-06-01"},
                   json={"model": MODEL_NAME, "max_tokens": 50, "metadata": {"user_id": "u1"},
                         "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
                         "messages": [{"role": "user", "content": [
                             {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                             {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"},
                                                               {"type": "text", "text": "hello"}]},
                             {"role": "ctx", "content": "some context"}],
                         "temperature": 0.5, "top_p": 0.9, "top_k": 20})
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [{"type": "text", "text": "Fine."}]


def test_system_messages_inside_messages_render_where_they_stand(scripted_server):
    """Claude Code sends `role: "system"` inside `messages` (beta mid-conversation-system)."""
    r = httpx.post(scripted_server.url + "/v1/messages/render?beta=true", timeout=30, json={
        "model": MODEL_NAME, "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": "first"},
                     {"role": "system", "content": [{"type": "text", "text": "Environment: /tmp",
                                                     "cache_control": {"type": "ephemeral"}}]},
                     {"role": "assistant", "content": "ok"},
                     {"role": "system", "content": "Now be verbose."},
                     {"role": "user", "content": "second"}]})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    order = [prompt.index(t) for t in ("You are terse.", "first", "]~b]system\nEnvironment: /tmp[e~[",
                                       "ok", "]~b]system\nNow be verbose.[e~[", "second")]
    assert order == sorted(order), prompt


def test_omitted_thinking_travels_in_the_signature(scripted, scripted_server):
    """`thinking.display: "omitted"` (Claude Code's default): the response's thinking blocks are
    empty, their signature carries the text, and the next turn renders it back."""
    engine = scripted_server.client
    client = scripted(SCRIPT)
    out = client.messages.create(model=MODEL_NAME, max_tokens=300, messages=ASK, tools=[WEATHER],
                                 thinking={"type": "adaptive", "display": "omitted"})
    thinking = out.content[0]
    assert thinking.type == "thinking" and thinking.thinking == "" and thinking.signature
    with client.messages.stream(model=MODEL_NAME, max_tokens=300, messages=ASK, tools=[WEATHER],
                                thinking={"type": "adaptive", "display": "omitted"}) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
    assert "thinking_delta" not in kinds and "signature_delta" in kinds
    for display in ("summarized", "updates"):           # what Claude Code versions send: the text shows
        shown = client.messages.create(model=MODEL_NAME, max_tokens=300, messages=ASK, tools=[WEATHER],
                                       thinking={"type": "adaptive", "display": display})
        assert shown.content[0].thinking == "The user wants weather."
    scripted("Sunny.")
    first = len(engine.requests)
    later = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": out.content[-1].id, "content": "22 C"}]}]
    client.messages.create(model=MODEL_NAME, max_tokens=50, messages=later, tools=[WEATHER])
    assert "<mm:think>\nThe user wants weather.\n</mm:think>" in prompt_of(engine.requests[first], engine.tokenizer)
    # a signature this server did not issue: the block's own text, as given
    foreign = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "my own thought", "signature": "EqQBCkYIBxgCKkD"},
        {"type": "text", "text": "Hi."}]}, {"role": "user", "content": "again"}]
    first = len(engine.requests)
    client.messages.create(model=MODEL_NAME, max_tokens=50, messages=foreign)
    assert "<mm:think>\nmy own thought\n</mm:think>" in prompt_of(engine.requests[first], engine.tokenizer)


def test_clear_thinking_edit_drops_earlier_thinking(scripted_server):
    """context_management's clear_thinking edit (Claude Code sends it) changes the prompt."""
    turns = []
    for n in range(3):
        turns += [{"role": "user", "content": f"question {n}"},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": f"thought {n}", "signature": "s"},
                                                    {"type": "text", "text": f"answer {n}"}]}]
    turns.append({"role": "user", "content": "last"})

    def prompt(edit):
        r = httpx.post(scripted_server.url + "/v1/messages/render", timeout=30, json={
            "model": MODEL_NAME, "messages": turns, **({"context_management": {"edits": [edit]}} if edit else {})})
        assert r.status_code == 200, r.text
        return r.json()["prompt"]
    kept = lambda text: [n for n in range(3) if f"thought {n}" in text]      # noqa: E731
    assert kept(prompt(None)) == [0, 1, 2]
    assert kept(prompt({"type": "clear_thinking_20251015", "keep": "all"})) == [0, 1, 2]
    assert kept(prompt({"type": "clear_thinking_20251015"})) == [2]
    assert kept(prompt({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}})) == [1, 2]
    assert kept(prompt({"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 10}})) \
        == [0, 1, 2]                                                           # accepted, not applied


def test_server_tools_are_dropped(scripted, scripted_server):
    """Anthropic's server tools run on Anthropic's side: left out of the prompt, not a 400."""
    engine = scripted_server.client
    client = scripted(SCRIPT)
    first = len(engine.requests)
    out = client.messages.create(model=MODEL_NAME, max_tokens=300, messages=ASK, tools=[
        WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}])
    prompt = prompt_of(engine.requests[first], engine.tokenizer)
    assert '"get_weather"' in prompt and "web_search" not in prompt
    assert out.content[-1].name == "get_weather"


def test_head_of_the_base_url_is_answered(scripted_server):
    """Claude Code probes the base URL with HEAD / before its requests."""
    assert httpx.head(scripted_server.url + "/", timeout=10).status_code == 200
    assert httpx.get(scripted_server.url + "/", timeout=10).json()["name"] == "m3serve"


HOSTILE = [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "system", "content": 5}]}, "messages.0.content"),
    ({"thinking": {"type": "adaptive", "display": 3}}, "thinking.display"),
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": {"value": -1}}]}},
     "context_management.edits.0.keep"),
    ({"context_management": {"edits": "all"}}, "context_management.edits"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.source"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}, "messages.0.content.0.text"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
     "messages.0.content.0.input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]},
     "messages.0.content.0.is_error"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image", "source": {}}]}]}]},
     "messages.0.content.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}]}]},
     "messages.0.content.0.type: 'document' blocks (PDFs, text documents) are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}]},
     "messages.0.content.0.content.0.type: 'document' blocks (PDFs"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_gone", "content": "x"}]}]},
     "messages.0.content.0.tool_use_id: no tool_use with id 'toolu_gone' comes before it"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "x"},
                                                {"type": "tool_result", "tool_use_id": "toolu_b", "content": "y"}]}]},
     "messages.1.content.1.tool_use_id: no tool_use with id 'toolu_b' comes before it"),
    ({"system": 5}, "system"),
    ({"system": [{"type": "tool_use"}]}, "system.0.type"),
    ({"tools": [{"name": "f", "input_schema": "x"}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools.0.input_schema.type"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": "x"}}]},
     "tools.0.input_schema.properties"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "required": "a"}}]}, "tools.0.input_schema.required"),
    ({"tools": [{"type": 5, "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]}, "tools.1.name"),
    ({"tools": [{"name": "", "input_schema": {}}]}, "tools.0.name"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice.type"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"stop_sequences": "STOP"}, "stop_sequences"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_k": -5}, "top_k"),
    ({"stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "x " * 200_000}]}, "prompt is too long"),
]


@pytest.mark.parametrize("change,named", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_input_is_a_named_400(scripted, scripted_server, change, named):
    scripted("ok")
    body = {"model": MODEL_NAME, "max_tokens": 20, "messages": ASK, **change}
    r = httpx.post(scripted_server.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    ok = httpx.post(scripted_server.url + "/v1/messages", timeout=30,
                    json={"model": MODEL_NAME, "max_tokens": 20, "messages": ASK})
    assert ok.status_code == 200          # still serving


def test_odd_tool_schemas_never_500(scripted, scripted_server):
    scripted("ok")
    for schema in ({"type": "object", "properties": {"a": {"type": 5}}},
                   {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                   {"type": "object", "properties": {"a": {"type": "array", "items": "x"}}},
                   {"type": "object", "properties": {"a": {"anyOf": "x"}}}):
        for choice in ({"type": "auto"}, {"type": "any"}):
            r = httpx.post(scripted_server.url + "/v1/messages", timeout=30, json={
                "model": MODEL_NAME, "max_tokens": 20, "messages": ASK,
                "tools": [{"name": "f", "input_schema": schema}], "tool_choice": choice})
            assert r.status_code in (200, 400), (schema, r.text)
            if r.status_code == 400:
                assert r.json()["error"]["type"] == "invalid_request_error"


def test_error_shapes_of_other_statuses(scripted_server):
    r = httpx.post(scripted_server.url + "/v1/messages", timeout=30,
                   json={"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": ASK})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert "claude-sonnet-4-5" in r.json()["error"]["message"]
    r = httpx.post(scripted_server.url + "/v1/messages", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(scripted_server.url + "/v1/messages", content=b"[" * 100 + b"]" * 100, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=scripted_server.url, api_key="x", max_retries=0).messages.count_tokens(
            model="nope", messages=ASK)


# --- the real engine (tiny model, random weights)

LIGHT = {"name": "set_light", "input_schema": {"type": "object", "required": ["room", "on"], "properties": {
    "room": {"enum": ["hall", "attic"]}, "on": {"type": "boolean"}}}}
DOOR = {"name": "lock_door", "input_schema": {"type": "object", "required": ["locked"],
                                              "properties": {"locked": {"type": "boolean"}}}}


def _live(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def test_live_create_stream_and_count(server):
    client = _live(server)
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=ASK).input_tokens
    tokenized = httpx.post(server.url + "/tokenize", timeout=30, json={"messages": ASK}).json()["count"]
    assert counted == tokenized
    out = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=ASK, extra_body={"temperature": 0.0})
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == counted
    assert 1 <= out.usage.output_tokens <= 12 and out.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(model=MODEL_NAME, max_tokens=12, messages=ASK,
                                extra_body={"temperature": 0.0}) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump()["content"] == out.model_dump()["content"]      # greedy: the same
    again = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=ASK, extra_body={"temperature": 0.0})
    assert again.usage.cache_read_input_tokens > 0        # the prompt's full blocks were cached


def test_live_stream_start_and_end_split_the_prompt_alike(server):
    """message_start's usage and the final message_delta's agree on a prefix-cache hit."""
    ask = [{"role": "user", "content": "Tell me about caching, at length. " * 20}]
    client = _live(server)
    client.messages.create(model=MODEL_NAME, max_tokens=2, messages=ask)            # caches the prompt
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": MODEL_NAME, "max_tokens": 3, "messages": ask, "stream": True})
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    start = events[0]["message"]["usage"]
    end = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert end["cache_read_input_tokens"] > 0
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        assert start[key] == end[key], (key, start, end)


PIXEL = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


def test_live_text_only_model_refuses_images_in_count_tokens_too(server):
    """count_tokens answers as create does: an image on a model without a vision tower is a
    400 naming the block (so is /tokenize with an image part)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, {
        "type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PIXEL}}]}]
    client = _live(server)
    for call in (lambda: client.messages.create(model=MODEL_NAME, max_tokens=5, messages=messages),
                 lambda: client.messages.count_tokens(model=MODEL_NAME, messages=messages)):
        with pytest.raises(anthropic.BadRequestError, match="messages.0.content.1: this model is served without "
                                                            "a vision tower"):
            call()
    r = httpx.post(server.url + "/tokenize", timeout=30, json={"model": MODEL_NAME, "messages": [{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PIXEL}"}}]}]})
    assert r.status_code == 400 and "without a vision tower" in r.json()["error"]["message"], r.text


def test_live_max_tokens(server):
    out = _live(server).messages.create(model=MODEL_NAME, max_tokens=1, messages=ASK, thinking={"type": "disabled"},
                                        extra_body={"temperature": 0.0})
    assert out.usage.output_tokens == 1 and out.stop_reason == "max_tokens"


@pytest.mark.parametrize("choice,thinking,tools,max_tokens", [
    ({"type": "tool", "name": "lock_door"}, {"type": "disabled"}, [LIGHT, DOOR], 120),
    ({"type": "any"}, {"type": "enabled", "budget_tokens": 4}, [DOOR], 120),
])
def test_live_forced_tool_choice_makes_a_valid_call(server, choice, thinking, tools, max_tokens):
    """Random weights never call a tool by themselves: the call comes from the grammar (in the
    second case after the server closed the thinking block at its budget)."""
    client = _live(server)
    with client.messages.stream(model=MODEL_NAME, max_tokens=max_tokens, messages=ASK, tools=tools,
                                tool_choice=choice, thinking=thinking, extra_body={"temperature": 0.0}) as stream:
        out = stream.get_final_message()
    calls = [b for b in out.content if b.type == "tool_use"]
    assert calls and not [b for b in out.content if b.type == "text"]
    if out.stop_reason == "max_tokens":
        # "any" may repeat invokes up to max_tokens; only the last one can be cut (greedy
        # decoding: the first one is complete, deterministically)
        calls = calls[:-1] or calls
    else:
        assert out.stop_reason == "tool_use"
    for call in calls:
        if choice["type"] == "tool":
            assert call.name == choice["name"]
        if call.name == "set_light":
            assert call.input["room"] in ("hall", "attic") and isinstance(call.input["on"], bool)
        else:
            assert call.name == "lock_door" and isinstance(call.input["locked"], bool)
    if thinking["type"] == "enabled":
        assert out.content[0].type == "thinking"


def test_chat_completions_passes_reasoning_back_too(scripted_server):
    """The same continuity on /v1/chat/completions: an assistant turn's reasoning_content (with
    its tool call) is rendered back into the next prompt."""
    r = httpx.post(scripted_server.url + "/v1/chat/completions/render", timeout=30, json={
        "model": MODEL_NAME, "chat_template_kwargs": {"thinking_mode": "enabled"},
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}],
        "messages": [*ASK, {"role": "assistant", "content": None, "reasoning_content": "need the tool",
                            "tool_calls": [{"id": "c1", "type": "function", "function": {
                                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "]~b]ai\n<mm:think>\nneed the tool\n</mm:think>\n" + f"{NS}<tool_call>" in prompt
    assert prompt.endswith("]~b]ai\n<mm:think>\n")
