"""MiniMax-M3.1's `reasoning_effort` (max, xhigh, high, medium, low) through every API: Chat
Completions' field (and chat_template_kwargs), Responses' `reasoning.effort`, Anthropic's
`output_config.effort`, /tokenize; the template writes `<effort>LEVEL</effort>` at the end of the
system turn. Chat's field and Responses' take OpenAI's values (none and minimal too) alike: each
sets the thinking mode and the level; anything else is a 400 naming the field. Prompts are read back from the render
endpoints and from what the scripted engine received; one live-server round trip."""
import httpx
import pytest

from serverutil import MODEL_NAME

LEVELS = ("max", "xhigh", "high", "medium", "low")
ASK = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, timeout=30, json={"model": MODEL_NAME, **body})


def _chat_prompt(server, **body) -> str:
    r = _post(server, "/v1/chat/completions/render", {"messages": ASK, **body})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_is_written_into_the_system_turn(scripted_server, level):
    opened = "<mm:think>\n" if level in ("max", "xhigh", "high") else ""      # high and above: thinking on
    assert _chat_prompt(scripted_server, reasoning_effort=level) == \
        f"]~!b[]~b]system\n<effort>{level}</effort>[e~[\n]~b]user\nhi[e~[\n]~b]ai\n{opened}"
    # the level alone through chat_template_kwargs (the thinking mode stays the default)
    assert _chat_prompt(scripted_server, chat_template_kwargs={"reasoning_effort": level}) == \
        f"]~!b[]~b]system\n<effort>{level}</effort>[e~[\n]~b]user\nhi[e~[\n]~b]ai\n"


def test_effort_follows_the_system_message_and_tools(scripted_server):
    plain = _chat_prompt(scripted_server)
    assert "<effort>" not in plain and "]~b]system" not in plain
    system = [{"role": "system", "content": "Be brief."}, *ASK]
    assert _chat_prompt(scripted_server, messages=system, reasoning_effort="medium").startswith(
        "]~!b[]~b]system\nBe brief.\n\n<effort>medium</effort>[e~[\n]~b]user\nhi")
    with_tools = _chat_prompt(scripted_server, messages=system, tools=[TOOL], reasoning_effort="low")
    turn = with_tools.split("[e~[")[0]
    assert turn.startswith("]~!b[]~b]system\nBe brief.\n\n# Tools")
    assert turn.endswith("</tool_call>\n\n<effort>low</effort>")
    # thinking mode and effort are independent
    assert _chat_prompt(scripted_server, reasoning_effort="high",
                        chat_template_kwargs={"thinking_mode": "enabled"}).endswith("]~b]ai\n<mm:think>\n")


@pytest.mark.parametrize("body, words, param", [
    ({"reasoning_effort": "ultra"},
     "reasoning_effort must be one of ['none', 'minimal', 'low', 'medium', 'high', 'xhigh', 'max']",
     "reasoning_effort"),
    ({"reasoning_effort": "HIGH"}, "got 'HIGH'", "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort", "reasoning_effort"),
    ({"chat_template_kwargs": {"reasoning_effort": "turbo"}}, "chat_template_kwargs.reasoning_effort must be one of",
     "chat_template_kwargs"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "max"}},
     "reasoning_effort 'low' and chat_template_kwargs.reasoning_effort 'max' disagree", "reasoning_effort"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/render", "/tokenize"])
def test_other_values_are_a_400_naming_the_field(scripted_server, path, body, words, param):
    r = _post(scripted_server, path, {"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"]
    assert error["param"] == param


def test_tokenize_counts_the_effort_tag(scripted_server):
    def count(**extra):
        r = _post(scripted_server, "/tokenize", {"messages": ASK, **extra})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    assert count(reasoning_effort="xhigh") == scripted_server.client.tokenizer.encode(
        _chat_prompt(scripted_server, reasoning_effort="xhigh"), add_special_tokens=False).ids
    assert len(count(reasoning_effort="xhigh")) > len(count())


def _received_prompt(server) -> str:
    return server.client.tokenizer.decode(server.client.requests[-1].prompt_token_ids, skip_special_tokens=False)


@pytest.mark.parametrize("effort, tag, opened", [
    ("max", "<effort>max</effort>", True), ("xhigh", "<effort>xhigh</effort>", True),
    ("medium", "<effort>medium</effort>", False), ("low", "<effort>low</effort>", False),
    ("minimal", None, False), ("none", None, False),
])
def test_responses_reasoning_effort_maps_to_the_level(scripted_server, effort, tag, opened):
    scripted_server.client.script = "Fine."
    r = _post(scripted_server, "/v1/responses", {"input": "hi", "reasoning": {"effort": effort},
                                                 "max_output_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["reasoning"]["effort"] == effort
    prompt = _received_prompt(scripted_server)
    if tag is None:
        assert "<effort>" not in prompt
    else:
        assert f"]~b]system\n{tag}[e~[\n" in prompt
    assert prompt.endswith("]~b]ai\n<mm:think>\n") == opened


OPENAI_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@pytest.mark.parametrize("effort", OPENAI_EFFORTS)
def test_chat_and_responses_take_the_same_efforts_alike(scripted_server, effort):
    """OpenAI's values (its SDK's ReasoningEffort) in Chat's `reasoning_effort`, /tokenize's and
    Responses' `reasoning.effort`: one prompt for one effort (thinking mode and M3.1 level)."""
    scripted_server.client.script = "Fine."
    r = _post(scripted_server, "/v1/responses", {"input": "hi", "reasoning": {"effort": effort},
                                                 "max_output_tokens": 8})
    assert r.status_code == 200, r.text
    chat = _chat_prompt(scripted_server, reasoning_effort=effort)
    assert chat == _received_prompt(scripted_server)
    r = _post(scripted_server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "reasoning_effort": effort})
    assert r.status_code == 200, r.text
    assert _received_prompt(scripted_server) == chat
    tokens = _post(scripted_server, "/tokenize", {"messages": ASK, "reasoning_effort": effort}).json()["tokens"]
    assert tokens == scripted_server.client.tokenizer.encode(chat, add_special_tokens=False).ids
    # an explicit thinking_mode wins over the effort's, in both
    kwargs = {"thinking_mode": "enabled" if effort in ("none", "minimal") else "disabled"}
    r = _post(scripted_server, "/v1/responses", {"input": "hi", "reasoning": {"effort": effort},
                                                 "chat_template_kwargs": kwargs, "max_output_tokens": 8})
    assert r.status_code == 200, r.text
    assert _chat_prompt(scripted_server, reasoning_effort=effort, chat_template_kwargs=kwargs) == \
        _received_prompt(scripted_server)


def test_responses_effort_outside_its_levels_is_a_400(scripted_server):
    r = _post(scripted_server, "/v1/responses", {"input": "hi", "reasoning": {"effort": "ultra"}})
    assert r.status_code == 400 and "reasoning.effort" in r.text
    r = _post(scripted_server, "/v1/responses", {"input": "hi", "chat_template_kwargs": {"reasoning_effort": "x"}})
    assert r.status_code == 400 and "chat_template_kwargs.reasoning_effort must be one of" in r.text
    # an explicit chat_template_kwargs level wins over reasoning.effort's
    r = _post(scripted_server, "/v1/responses", {"input": "hi", "reasoning": {"effort": "high"},
                                                 "chat_template_kwargs": {"reasoning_effort": "low"},
                                                 "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    assert "<effort>low</effort>" in _received_prompt(scripted_server)


def _messages_prompt(server, **extra) -> httpx.Response:
    return httpx.post(server.url + "/v1/messages/render", timeout=30,
                      json={"model": MODEL_NAME, "messages": ASK, **extra})


@pytest.mark.parametrize("level", ["low", "medium", "high", "xhigh", "max"])
def test_anthropic_output_config_effort(scripted_server, level):
    r = _messages_prompt(scripted_server, output_config={"effort": level})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"].startswith(f"]~!b[]~b]system\n<effort>{level}</effort>[e~[\n")


@pytest.mark.parametrize("config, words", [
    ({"effort": "extreme"}, "output_config.effort: must be one of"),
    ("fast", "output_config: must be an object"),
])
def test_anthropic_bad_effort_is_a_400(scripted_server, config, words):
    r = _messages_prompt(scripted_server, output_config=config)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert words in r.json()["error"]["message"]
    # other output_config keys are accepted and do not touch the prompt
    assert _messages_prompt(scripted_server, output_config={"format": {"type": "text"}}).json()["prompt"] == \
        _messages_prompt(scripted_server).json()["prompt"]


def test_live_server_generates_with_an_effort(server):
    def chat(**extra):
        return httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "messages": ASK, "max_tokens": 3, "temperature": 0, **extra})
    base, low = chat(), chat(reasoning_effort="low")
    assert base.status_code == low.status_code == 200, low.text
    tag = len(httpx.post(server.url + "/tokenize", json={"prompt": "]~b]system\n<effort>low</effort>[e~[\n",
                                                         "add_special_tokens": False}).json()["tokens"])
    assert low.json()["usage"]["prompt_tokens"] == base.json()["usage"]["prompt_tokens"] + tag
    bad = chat(reasoning_effort="ultra")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


@pytest.mark.parametrize("extra", [{"reasoning_effort": "high"}, {"chat_template_kwargs": {"thinking_mode": "enabled"}}])
def test_chat_structured_output_after_forced_thinking_is_a_400_as_in_responses(scripted_server, extra):
    """The grammar holds from the first output token: it cannot follow an opened thinking block
    (Responses' text.format rule, on Chat's response_format too)."""
    scripted_server.client.script = "{}"
    body = {"messages": ASK, "max_tokens": 4, "response_format": {"type": "json_object"}}
    r = _post(scripted_server, "/v1/chat/completions", {**body, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"
    assert "cannot follow forced thinking" in r.json()["error"]["message"]
    assert _post(scripted_server, "/v1/chat/completions", {**body, "reasoning_effort": "low"}).status_code == 200
