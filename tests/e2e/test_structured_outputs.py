"""Structured outputs through the server (xgrammar token masks): OpenAI's response_format,
vLLM's structured_outputs and guided_* fields, streaming and not; a bad grammar is a 400.
The tiny model's text is noise, so every constraint must hold by the mask alone."""
import json
import re

import httpx
import pytest
from serverutil import MODEL_NAME, LiveServer

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar")

COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    srv = LiveServer(tiny_dir, "--tool-call-parser", "minimax_m3", "--reasoning-parser", "minimax_m3",
                     "--enable-auto-tool-choice", log_path=tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


def chat(server, **fields):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "pick one"}], "max_tokens": 80, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    return r


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_holds(server, temperature):
    for seed in range(3):
        r = chat(server, temperature=temperature, seed=seed,
                 structured_outputs={"json": COLOR, "disable_any_whitespace": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        value = json.loads(choice["message"]["content"])
        assert choice["finish_reason"] == "stop" and value["color"] in ("red", "green", "blue")
        assert isinstance(value["n"], int) and 0 <= value["n"] <= 99


def test_response_format_json_schema_and_object(server):
    r = chat(server, temperature=0, max_tokens=300,
             response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert json.loads(choice["message"]["content"])["color"] in ("red", "green", "blue")
    else:     # free whitespace may run long on random weights, but the text is still a JSON prefix
        assert choice["message"]["content"].lstrip().startswith("{")
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": "data:", "max_tokens": 20, "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].lstrip().startswith("{")


def test_regex_and_choice_streaming_and_not(server):
    for seed in range(3):
        r = chat(server, temperature=1.0, seed=seed, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"})
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["message"]["content"]), r.text
    choices = ["alpha", "beta", "gamma delta"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": 3,
            "guided_choice": choices, "stream": True}) as r:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"])
    assert text in choices


@pytest.mark.parametrize("fields,words", [
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex is not valid"),
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs.json is not valid"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"structured_outputs": {"colour": "red"}}, "colour"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "give one constraint"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "needs a stop token"),
    # types the engine's message decoder would refuse (it used to stop the engine)
    ({"structured_outputs": {"json_object": 1}}, "json_object must be a boolean"),
    ({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": "yes"}}, "disable_any_whitespace must be a boolean"),
    # grammars that allow no first token (they used to fail the step with a 500)
    ({"structured_outputs": {"grammar": "root ::= root"}}, "matches no output"),
    ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "matches no output"),
    ({"structured_outputs": {"choice": ["a"]}, "min_tokens": 5}, "cannot be combined with min_tokens"),
])
def test_bad_constraints_are_400(server, fields, words):
    r = chat(server, **fields)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert chat(server, max_tokens=2).status_code == 200


BAD_SCHEMA = {"type": 5}


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"guided_json": BAD_SCHEMA}, "guided_json"),
    ("/v1/chat/completions", {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format.json_schema.schema"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
     "text.format.schema"),
])
def test_a_bad_schema_is_named_by_the_field_the_request_used(server, path, fields, param):
    body = ({"input": "pick one", "max_output_tokens": 20} if path == "/v1/responses" else
            {"prompt": "pick one", "max_tokens": 20} if path == "/v1/completions" else
            {"messages": [{"role": "user", "content": "pick one"}], "max_tokens": 20})
    r = httpx.post(server.url + path, json={"model": MODEL_NAME, **body, **fields}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(f"{param} is not valid"), error
    assert error["param"] == param.split(".")[0]


def test_a_grammar_dead_end_fails_only_its_request(server):
    """A grammar whose first token is allowed and then nothing: that request ends with a 400
    naming the dead end (streamed: an error event), and a request running beside it is served."""
    import concurrent.futures

    dead = {"structured_outputs": {"grammar": 'root ::= "a" x\nx ::= x'}, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        normal = pool.submit(chat, server, max_tokens=40, ignore_eos=True)
        r = chat(server, **dead)
        assert normal.result().status_code == 200
    assert r.status_code == 400, r.text
    assert "allows no token" in r.json()["error"]["message"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                            "max_tokens": 20, "stream": True, **dead}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["error"]["code"] == 400 and "allows no token" in events[-1]["error"]["message"]
    assert chat(server, max_tokens=2).status_code == 200


def test_logit_bias_steers_sampling(server):
    def tokens(**fields):
        body = {"model": MODEL_NAME, "prompt": "the river", "max_tokens": 6, "ignore_eos": True, "temperature": 0,
                "logprobs": 0, **fields}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    plain = tokens()
    ids = httpx.post(server.url + "/tokenize", json={"prompt": " cache"}, timeout=30).json()["tokens"]
    forced = tokens(logit_bias={str(ids[0]): 100})
    favoured = httpx.post(server.url + "/detokenize", json={"tokens": ids[:1]}, timeout=30).json()["prompt"]
    assert forced == [favoured] * 6 and forced != plain              # every step picks the favoured token
    first = httpx.post(server.url + "/tokenize", json={"prompt": plain[0]}, timeout=30).json()["tokens"]
    assert tokens(logit_bias={str(first[0]): -100})[0] != plain[0]    # and a banned one is never picked


LIGHT = {"type": "function", "function": {"name": "set_light", "parameters": {
    "type": "object", "required": ["room", "on"], "properties": {
        "room": {"enum": ["hall", "attic"]}, "on": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}}}}}
DOOR = {"type": "function", "function": {"name": "lock_door", "parameters": {
    "type": "object", "required": ["locked"], "properties": {"locked": {"type": "boolean"}}}}}
NO_THINKING = {"thinking_mode": "disabled"}


def check_call(call):
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "set_light":
        assert args["room"] in ("hall", "attic") and isinstance(args["on"], bool)
        assert set(args) <= {"room", "on", "level"} and args.get("level", 1) in (1, 2, 3)
    else:
        assert call["function"]["name"] == "lock_door" and set(args) == {"locked"}
        assert isinstance(args["locked"], bool)


def test_named_tool_choice_is_enforced(server):
    """Random weights never write a tool call by themselves: the call comes from the grammar."""
    for seed in range(3):
        r = chat(server, temperature=1.0, seed=seed, max_tokens=200, tools=[LIGHT, DOOR],
                 tool_choice={"type": "function", "function": {"name": "set_light"}},
                 chat_template_kwargs=NO_THINKING)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "set_light" and not choice["message"]["content"]
        check_call(call)
        assert choice["finish_reason"] == "stop"          # OpenAI's for a named choice


def test_required_tool_choice_is_enforced_streaming(server):
    for seed in range(2):
        calls: dict = {}
        finish = None
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "do it"}], "max_tokens": 160,
                "temperature": 1.0, "seed": seed, "stream": True, "tools": [LIGHT, DOOR],
                "tool_choice": "required", "chat_template_kwargs": NO_THINKING}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                [c] = json.loads(line[6:])["choices"]
                assert not c["delta"].get("content")
                for d in c["delta"].get("tool_calls", []):
                    entry = calls.setdefault(d["index"], {"function": {"name": "", "arguments": ""}})
                    entry["function"]["name"] += d.get("function", {}).get("name") or ""
                    entry["function"]["arguments"] += d.get("function", {}).get("arguments") or ""
                finish = c["finish_reason"] or finish
        assert finish in ("tool_calls", "length")   # invokes may repeat up to max_tokens, the last one cut
        complete = list(calls.values())[:-1] if finish == "length" else list(calls.values())
        assert complete, f"no complete tool call: {calls}"
        for call in complete:
            check_call(call)


def test_a_slow_grammar_does_not_hold_up_a_forced_tool_call(server):
    """Two requests whose grammars take seconds to compile (long literal sequences, just under
    the size limit) are in the engine; a simple forced tool call sent after them is answered
    before either of them, within a bound. (The engine used to compile in its loop, so the
    tool call waited for both compilations.)"""
    import concurrent.futures
    import time

    slow = "root ::= " + " ".join(f'"s{i}"' for i in range(20000))
    tool_call = {"tools": [DOOR], "tool_choice": "required", "max_tokens": 2, "chat_template_kwargs": NO_THINKING}
    assert chat(server, **tool_call).status_code == 200        # its grammar cached: what is left is ours
    done: dict = {}

    def timed(name, **fields):
        r = chat(server, **fields)
        done[name] = time.monotonic()
        return r

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        slow_calls = [pool.submit(timed, f"slow{k}", max_tokens=2, structured_outputs={"grammar": slow + f' "{k}"'})
                      for k in range(2)]
        time.sleep(0.5)                                          # both are compiling now
        sent = time.monotonic()
        r = timed("tool", **tool_call)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"] or r.json()["choices"][0]["finish_reason"] == "length"
        for future in slow_calls:
            assert future.result().status_code == 200, future.result().text
    assert done["tool"] < min(done["slow0"], done["slow1"]), done
    assert done["tool"] - sent < 10.0
