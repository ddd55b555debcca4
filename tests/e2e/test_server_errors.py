"""Malformed and hostile requests get their 4xx with the OpenAI error body and the server keeps
serving; the API key, the body-size limit, and 503 + Retry-After past the waiting-queue bound."""
import concurrent.futures

import httpx
import pytest

from serverutil import MODEL_NAME

C, CH = "/v1/completions", "/v1/chat/completions"
GOOD_CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}

NESTED: list = []
for _ in range(80):
    NESTED = [NESTED]

# (path, body: dict or raw bytes, status, words the message must contain, param or None)
BAD_REQUESTS = [
    (C, b"{bad json", 400, "not valid JSON", None),
    (C, b"[1, 2]", 400, "JSON object", None),
    (C, b"\xff\xfe", 400, "not valid JSON", None),
    (C, {"max_tokens": 4}, 400, "prompt is required", "prompt"),
    (C, {"prompt": 5}, 400, "prompt", "prompt"),
    (C, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens must be >= 1", "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be >= 1", "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens is too large", "max_tokens"),
    (C, {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    (C, {"prompt": "hi", "top_p": 2}, 400, "top_p", "top_p"),
    (C, {"prompt": "hi", "top_k": -5}, 400, "top_k", "top_k"),
    (C, {"prompt": "hi", "frequency_penalty": 3}, 400, "frequency_penalty", "frequency_penalty"),
    (C, {"prompt": "hi", "n": 0}, 400, "n must be >= 1", "n"),
    (C, {"prompt": "hi", "n": 10**9}, 400, "n must be <= 128", "n"),
    (C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs must be <= 20", "logprobs"),
    (C, {"prompt": "hi", "seed": "abc"}, 400, "seed", "seed"),
    (C, {"prompt": "hi", "stop": [1, 2]}, 400, "stop", "stop"),
    (C, {"prompt": "hi", "stream": "maybe"}, 400, "stream", "stream"),
    (C, {"prompt": "hi", "stream_options": 3}, 400, "stream_options", "stream_options"),
    (C, {"prompt": "hi", "logit_bias": {"five": 1.0}}, 400, "logit_bias keys must be token ids", "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias values must be numbers in [-100, 100]", "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "outside the vocabulary", "logit_bias"),
    (C, {"prompt": "hi", "echo": True, "logprobs": 1, "kv_transfer_params": {"do_remote_decode": True}}, 400,
     "echo with logprobs needs the prompt computed here", "echo"),
    (C, {"prompt": ""}, 400, "prompt is empty", "prompt"),
    (C, {"prompt": [1] * 131_072}, 400, "prompt is too long", "prompt"),
    (C, {"prompt": [999999]}, 400, "outside the vocabulary", "prompt"),
    (C, {"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4", "model"),
    (CH, {"messages": []}, 400, "messages", "messages"),
    (CH, {"messages": "hi"}, 400, "messages", "messages"),
    (CH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role", None),
    (CH, {"messages": [{"content": "hi"}]}, 400, "role is missing", None),
    (CH, {"messages": [{"role": "user", "content": 42}]}, 400, "content", None),
    (CH, {"messages": GOOD_CHAT, "tools": [{"type": "function", "function": {"description": "x"}}]},
     400, "tools.0.function.name", "tools.0.function.name"),
    (CH, {"messages": GOOD_CHAT, "tools": [{"type": "retrieval", "function": {"name": "f"}}]},
     400, "tools.0.type", "tools.0.type"),
    (CH, {"messages": GOOD_CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "nope", "tool_choice"),
    (CH, {"messages": GOOD_CHAT, "tool_choice": "required"}, 400, "tools", "tool_choice"),
    (CH, {"messages": GOOD_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "top_logprobs"),
    (CH, {"messages": GOOD_CHAT, "top_logprobs": 2}, 400, "top_logprobs requires logprobs", "top_logprobs"),
    (CH, {"messages": GOOD_CHAT, "chat_template_kwargs": {"thinking_mode": "sometimes"}}, 400, "thinking_mode",
     "chat_template_kwargs"),
    (CH, {"messages": GOOD_CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format",
     "response_format"),
    (CH, {"messages": GOOD_CHAT, "max_completion_tokens": -3}, 400, "max_tokens must be >= 1", "max_tokens"),
    (CH, {"messages": GOOD_CHAT, "max_tokens": -3, "max_completion_tokens": 5}, 400, "max_tokens must be >= 1",
     "max_tokens"),
    (CH, {"messages": GOOD_CHAT, "response_format": {}}, 400, "response_format.type is required", "response_format"),
    ("/detokenize", {"tokens": [-1]}, 400, "outside the vocabulary", "tokens"),
    ("/tokenize", {}, 400, "exactly one of prompt or messages", None),
    ("/v1/nowhere", {}, 404, "Not Found", None),
    # hostile: nothing here is m3serve's fault, so nothing is a 500
    (C, b'{"prompt": "hi", "x": ' + b"[" * 200000 + b"]" * 200000 + b"}", 400, "nested deeper", None),
    (C, {"prompt": "hi", "x": NESTED}, 400, "nested deeper than 64 levels", "x" + ".0" * 63),
    (CH, {"messages": GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": NESTED}}]},
     400, "nested deeper", None),
    (C, b'{"prompt": "hi \\ud800 there"}', 400, "unpaired UTF-16 surrogate", "prompt"),
    (CH, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "surrogate", "messages.0.content"),
    (C, b'{"prompt": "hi", "model": "\\ud83d"}', 400, "surrogate", "model"),
    (C, b'{"prompt": "hi", "\\ud800": 1}', 400, "key contains an unpaired", None),
    (C, {"prompt": "hi", "seed": 10**30}, 400, "64-bit", "seed"),
    (C, {"prompt": "hi", "top_k": -(2**70)}, 400, "64-bit", "top_k"),
    (C, b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", 400, "not valid JSON", None),
    (C, {"prompt": [True, 5]}, 400, "expected one of str, list[str], list[int], list[list[int]]", "prompt"),
    (C, {"prompt": [[3, False]]}, 400, "expected one of", "prompt"),
    (C, {"prompt": "hi", "stream": "yes"}, 400, "valid boolean", "stream"),
    (C, {"prompt": "hi", "ignore_eos": 1}, 400, "valid boolean", "ignore_eos"),
    (C, {"prompt": "hi", "max_tokens": "5"}, 400, "valid integer", "max_tokens"),
    (C, {"prompt": "hi", "stop_token_ids": [True]}, 400, "valid integer", "stop_token_ids.0"),
    ("/detokenize", {"tokens": [True]}, 400, "valid integer", "tokens.0"),
    (C, {"prompt": "hi", "model": "no-such-\u00e9\u4e2d\U0001f600"}, 404, "does not exist", "model"),
]


@pytest.mark.parametrize("path,body,status,words,param", BAD_REQUESTS,
                         ids=[f"{i}-{b if isinstance(b, bytes) else list(b)}"[:40] for i, (_, b, *_r)
                              in enumerate(BAD_REQUESTS)])
def test_bad_request_gets_openai_error_and_server_survives(server, path, body, status, words, param):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param


def test_good_request_after_the_bad_ones(server):
    r = httpx.post(server.url + C, json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True,
                                         "an_unknown_field": 1})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(server.url + "/ready").status_code == 200


def test_api_key_is_enforced(guarded_server):
    url = guarded_server.url
    body = {"prompt": "hi", "max_tokens": 2}
    missing = httpx.post(url + C, json=body)
    wrong = httpx.post(url + C, json=body, headers={"Authorization": "Bearer nope"})
    for r in (missing, wrong):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == 401 and "API key" in r.json()["error"]["message"]
    for route in ("/v1/models", "/docs", "/redoc", "/openapi.json"):     # the API and its documentation
        assert httpx.get(url + route).status_code == 401, route
    assert httpx.get(url + "/openapi.json", headers={"Authorization": "Bearer sekret"}).status_code == 200
    for route in ("/health", "/ready", "/metrics", "/version", "/get_load"):   # probes need no key
        assert httpx.get(url + route).status_code == 200, route
    ok = httpx.post(url + C, json=body, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_oversize_body_is_413(guarded_server):
    auth = {"Authorization": "Bearer sekret"}
    r = httpx.post(guarded_server.url + C, json={"prompt": "x" * 5000, "max_tokens": 1}, headers=auth)
    assert r.status_code == 413
    assert "exceeds the limit of 4096 bytes" in r.json()["error"]["message"]
    # a chunked body (no Content-Length) is counted as it arrives
    chunks = (b'{"prompt": "' + b"y" * 1000 for _ in range(6))
    r = httpx.post(guarded_server.url + C, content=chunks, headers=auth)
    assert r.status_code == 413
    assert httpx.post(guarded_server.url + C, json={"prompt": "hi", "max_tokens": 1}, headers=auth).status_code == 200


def test_full_waiting_queue_answers_503_with_retry_after(guarded_server):
    auth = {"Authorization": "Bearer sekret"}
    body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 40, "ignore_eos": True}

    def post(_):
        return httpx.post(guarded_server.url + C, json=body, headers=auth, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(post, range(8)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 503}, codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
            assert "--max-waiting-requests" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 40
    after = httpx.post(guarded_server.url + C, json={**body, "max_tokens": 2}, headers=auth)
    assert after.status_code == 200


def test_disable_fastapi_docs_removes_the_documentation_routes(tiny_dir):
    from serverutil import InProcessServer
    for disabled, status in ((False, 200), (True, 404)):
        srv = InProcessServer(tiny_dir, disable_fastapi_docs=disabled)
        try:
            for route in ("/docs", "/redoc", "/openapi.json"):
                assert httpx.get(srv.url + route, timeout=10).status_code == status, (disabled, route)
        finally:
            srv.stop()


@pytest.mark.parametrize("path,fields", [(C, {"n": 2}), (C, {"prompt": ["hello", "there"]}),
                                         (CH, {"n": 2, "messages": GOOD_CHAT})])
def test_more_sequences_than_the_waiting_bound_is_400_not_503(guarded_server, path, fields):
    """A request whose prompts x n could never wait at once is refused as a bad request, not
    told to retry (the bound is one)."""
    auth = {"Authorization": "Bearer sekret"}
    body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 2, **fields}
    if path == CH:
        del body["prompt"]
    r = httpx.post(guarded_server.url + path, json=body, headers=auth, timeout=60)
    assert r.status_code == 400, r.text
    assert "--max-waiting-requests 1" in r.json()["error"]["message"]
    single = {**body, "n": 1} if path == CH else {**body, "n": 1, "prompt": "hi"}
    assert httpx.post(guarded_server.url + path, json=single, headers=auth, timeout=60).status_code == 200
