"""The live server on the tiny model through the official `openai` client (sync and async,
streaming and not): greedy outputs equal the offline `LLM`'s, usage, logprobs, stop strings,
n > 1, tokenize/detokenize, disconnect frees blocks, and `m3serve bench serve` against it."""
import asyncio
import json
import math
import subprocess
import sys
import time

import httpx
import openai
import pytest

from refgreedy import assert_engine_no_near_ties
from serverutil import MODEL_NAME, REPO_ROOT

from m3serve.sampling_params import SamplingParams
from m3serve.serving.reasoning import MiniMaxM3ReasoningParser

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Say something about foxes."}]


@pytest.fixture(scope="module")
def offline(tiny_dir):
    from m3serve.llm import LLM
    return LLM(model=str(tiny_dir))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _offline_text(offline, prompt, **params) -> tuple[str, str]:
    out = offline.generate([prompt], SamplingParams(temperature=0.0, **params), use_tqdm=False)[0].outputs[0]
    return out.text, out.finish_reason


def test_models_lists_the_served_name(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == 131072


def test_greedy_completion_equals_offline_llm(client, offline):
    expected, reason = _offline_text(offline, PROMPT, max_tokens=12, ignore_eos=True)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(offline.get_tokenizer().encode(PROMPT).ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_streamed_completion_concatenates_to_the_same_text(client, offline):
    expected, _ = _offline_text(offline, PROMPT, max_tokens=10, ignore_eos=True)
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_greedy_chat_equals_offline_chat(client, offline):
    # CHAT's 10th greedy step is an exact bf16 tie (and two more lead by one ulp), so the two
    # processes' answers would agree only by rounding alike; this message's every step leads
    # its runner-up by 4 bf16 ulps or more (checked here), so a mismatch is a real difference
    chat = [{"role": "user", "content": "Say something about cats."}]
    offline_out = offline.chat(chat, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
                               use_tqdm=False)
    assert_engine_no_near_ties(offline_out, margin=0.25)
    expected = offline_out[0].outputs[0].text
    out = client.chat.completions.create(model=MODEL_NAME, messages=chat, max_completion_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
    message = out.choices[0].message
    # the server runs the reasoning parser; the same split of the offline text must come out
    reasoning, content = MiniMaxM3ReasoningParser(None).extract(expected)
    assert message.content == content
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == reasoning
    assert out.usage.completion_tokens == 10


def test_async_streamed_chat_n2_with_usage(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0.8, seed=7, n=2, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        texts, finish, usage = {0: "", 1: ""}, {}, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                texts[c.index] += (c.delta.content or "") + (c.delta.model_extra.get("reasoning_content") or "")
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
        full = await client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0.8, seed=7, n=2,
            extra_body={"ignore_eos": True})
        await client.close()
        return texts, finish, usage, full

    texts, finish, usage, full = asyncio.run(run())
    assert finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 12
    # seeded sampling is reproducible across streaming and not, per choice (child seed = seed + i)
    again = {c.index: (c.message.content or "") + (c.message.model_extra.get("reasoning_content") or "")
             for c in full.choices}
    assert again == texts
    assert texts[0] != texts[1]


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # a character split across tokens decodes to U+FFFD per token but once in the text
    assert "".join(lp.tokens).replace("\ufffd", "") == out.choices[0].text.replace("\ufffd", "")
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # keys are decoded strings: distinct byte-fragment tokens may all decode to U+FFFD
        assert 1 <= len(top) <= 4 and chosen <= 0.0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token


def test_chat_logprobs_top_k(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_stop_string_cuts_text_like_offline(client, offline):
    full, _ = _offline_text(offline, PROMPT, max_tokens=16, ignore_eos=True)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected, reason = _offline_text(offline, PROMPT, max_tokens=16, ignore_eos=True, stop=[stop])
    assert reason == "stop" and stop not in expected
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                         stop=[stop], stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_batch_of_prompts_and_token_ids(client, offline):
    ids = offline.get_tokenizer().encode(PROMPT).ids
    out = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] == by_index[1]  # greedy: both children of a prompt agree
    from_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert from_ids.choices[0].text == by_index[0]


def test_tokenize_detokenize_roundtrip(server, offline):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == offline.get_tokenizer().encode(PROMPT).ids and r["count"] == len(r["tokens"])
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == PROMPT
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > r["count"]


def test_disconnect_mid_stream_frees_blocks(server):
    before = server.metrics()
    body = {"model": MODEL_NAME, "prompt": PROMPT * 20, "max_tokens": 3000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            during = server.metrics()
            assert during["m3serve:num_requests_running"] == 1
            assert during["m3serve:kv_cache_usage_perc"] > 0
    after = server.wait_idle(20)
    assert after["m3serve:request_success_total"] == before.get("m3serve:request_success_total", 0) + 1
    assert after["m3serve:generation_tokens_total"] < before["m3serve:generation_tokens_total"] + 3000


def test_non_streaming_client_gone_aborts(server):
    before = server.metrics()
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    after = server.wait_idle(20)
    assert after["m3serve:generation_tokens_total"] < before["m3serve:generation_tokens_total"] + 3000
    assert after["m3serve:request_success_total"] == before.get("m3serve:request_success_total", 0) + 1


def test_metrics_count_tokens_and_latencies(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = server.metrics()
    assert after["m3serve:generation_tokens_total"] - before["m3serve:generation_tokens_total"] == 5
    assert after["m3serve:time_to_first_token_seconds_count"] - before["m3serve:time_to_first_token_seconds_count"] == 1
    assert after["m3serve:inter_token_latency_seconds_count"] - before["m3serve:inter_token_latency_seconds_count"] == 4
    assert after["m3serve:e2e_request_latency_seconds_count"] - before["m3serve:e2e_request_latency_seconds_count"] == 1
    assert after["m3serve:prefix_cache_queries_total"] > before["m3serve:prefix_cache_queries_total"]
    assert 0.0 <= after["m3serve:prefix_cache_hit_rate"] <= 1.0


def test_iteration_tokens_count_every_computed_token(server, client):
    """The per-step token histogram: a prompt no earlier request shares (no prefix-cache hit)
    computes its prompt tokens, then one token for each generated token after the first."""
    before = server.metrics()
    out = client.completions.create(model=MODEL_NAME, prompt="zq unique " + PROMPT, max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    after = server.wait_idle(20)
    computed = after["m3serve:iteration_tokens_total_sum"] - before.get("m3serve:iteration_tokens_total_sum", 0)
    assert after["m3serve:prefix_cache_hits_total"] == before["m3serve:prefix_cache_hits_total"]
    assert computed == out.usage.prompt_tokens + 4
    steps = after["m3serve:iteration_tokens_total_count"] - before.get("m3serve:iteration_tokens_total_count", 0)
    assert steps >= 5                                   # the prefill, then four decode steps
    # vLLM's names for dashboards built for vLLM: the same series under vllm:*
    for name in ("generation_tokens_total", "prompt_tokens_total", "num_requests_running", "kv_cache_usage_perc",
                 "iteration_tokens_total_count", "iteration_tokens_total_sum",
                 "time_to_first_token_seconds_count", "e2e_request_latency_seconds_sum", "request_success_total"):
        assert after["vllm:" + name] == after["m3serve:" + name], name


def test_bench_serve_against_the_server(server, tiny_dir, tmp_path):
    cmd = [sys.executable, "-m", "m3serve", "bench", "serve", "--base-url", server.url,
           "--tokenizer", str(tiny_dir), "--num-prompts", "4", "--random-input-len", "24",
           "--random-output-len", "6", "--random-range-ratio", "0", "--ignore-eos", "--max-concurrency", "2",
           "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["model_id"] == MODEL_NAME
    assert result["total_output_tokens"] == 4 * 6  # from usage.completion_tokens, ignore_eos
    assert result["mean_ttft_ms"] > 0 and math.isfinite(result["mean_tpot_ms"])


def test_echo_prepends_the_prompt(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    echoed = httpx.post(server.url + "/v1/completions", json={**body, "echo": True}, timeout=60).json()
    assert echoed["choices"][0]["text"] == PROMPT + plain
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "echo": True, "stream": True},
                      timeout=60) as r:
        pieces = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert pieces[0] == PROMPT and "".join(pieces) == PROMPT + plain


def test_echo_with_logprobs_scores_the_prompt_as_decoding_scored_it(server):
    """Oracle: the logprobs greedy decoding gave its tokens equal the prompt logprobs the echo
    computes when those tokens are sent back as part of the prompt (decode path vs prefill path)."""
    url = server.url + "/v1/completions"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    body = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    plain = httpx.post(url, json={**body, "prompt": ids, "return_token_ids": True}, timeout=60).json()["choices"][0]
    first, generated = plain["logprobs"], plain["token_ids"]
    assert plain["prompt_token_ids"] == ids and len(generated) == 6
    whole = ids + generated
    echoed = httpx.post(url, json={**body, "prompt": whole, "echo": True, "max_tokens": 2}, timeout=60).json()
    [choice] = echoed["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(whole) + 2 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    prompt_text = httpx.post(server.url + "/detokenize", json={"tokens": whole}, timeout=30).json()["prompt"]
    assert choice["text"].startswith(prompt_text) and lp["text_offset"][len(whole)] == len(prompt_text)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert lp["tokens"][len(ids):len(whole)] == first["tokens"]     # the same tokens went back in
    assert lp["token_logprobs"][len(ids):len(whole)] == pytest.approx(first["token_logprobs"], abs=2e-3)
    assert lp["top_logprobs"][len(ids)].keys() == first["top_logprobs"][0].keys()
    with httpx.stream("POST", url, json={**body, "prompt": whole, "echo": True, "max_tokens": 2, "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    joined = {key: sum((c["logprobs"][key] for c in chunks), []) for key in lp}
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
    assert joined["token_logprobs"][:len(whole)] == lp["token_logprobs"][:len(whole)]


def test_prompt_logprobs_score_the_prompt_as_decoding_scored_it(server):
    """Oracle as for echo: the logprobs decoding gave its greedy tokens equal their
    prompt_logprobs once sent back as a prompt; each position holds the prompt token and at most
    k others, ranked; the chat endpoint returns the field for its rendered prompt."""
    url = server.url + "/v1/completions"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    body = {"model": MODEL_NAME, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(url, json={**body, "prompt": ids, "logprobs": 0, "return_token_ids": True},
                       timeout=60).json()["choices"][0]
    whole = ids + plain["token_ids"]
    choice = httpx.post(url, json={**body, "prompt": whole, "max_tokens": 1, "prompt_logprobs": 2},
                        timeout=60).json()["choices"][0]
    field = choice["prompt_logprobs"]
    assert len(field) == len(whole) and field[0] is None and "logprobs" in choice
    for token, position in zip(whole[1:], field[1:]):
        assert str(token) in position and len(position) <= 3                  # the k = 2 best + the token
        assert sorted(e["rank"] for e in position.values() if e["rank"] <= 2) == [1, 2]
    scored = [field[len(ids) + i][str(t)]["logprob"] for i, t in enumerate(plain["token_ids"])]
    assert scored == pytest.approx(plain["logprobs"]["token_logprobs"], abs=2e-3)
    assert all(field[len(ids) + i][str(t)]["rank"] == 1 for i, t in enumerate(plain["token_ids"]))  # greedy
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        **body, "messages": CHAT, "prompt_logprobs": 0, "return_token_ids": True}, timeout=60).json()
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None
    assert all(str(t) in p for t, p in zip(chat["prompt_token_ids"][1:], chat["prompt_logprobs"][1:]))
    for bad, what in (({"prompt_logprobs": 2, "stream": True}, "stream"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
                      ({"prompt_logprobs": 21}, "prompt_logprobs")):
        r = httpx.post(url, json={**body, "prompt": PROMPT, **bad}, timeout=30)
        assert r.status_code == 400 and what in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_return_token_ids_streaming_and_not(server, route):
    chat = route.endswith("chat/completions")
    body = {"model": MODEL_NAME, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            **({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})}
    whole = httpx.post(server.url + route, json=body, timeout=60).json()
    prompt_ids = whole["prompt_token_ids"] if chat else whole["choices"][0]["prompt_token_ids"]
    assert len(prompt_ids) == whole["usage"]["prompt_tokens"] and len(whole["choices"][0]["token_ids"]) == 7
    with httpx.stream("POST", server.url + route, json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    streamed_prompt = [e.get("prompt_token_ids") or e["choices"][0].get("prompt_token_ids") for e in events]
    assert [p for p in streamed_prompt if p] == [prompt_ids]              # once, in the first chunk
    assert sum((e["choices"][0].get("token_ids") or [] for e in events), []) == whole["choices"][0]["token_ids"]


def test_created_is_each_requests_own_time(client):
    """`created` of a completion or chat completion (and of every chunk of its stream, all
    alike) is when that request was made, not when the server started."""
    started = client.models.list().data[0].created
    while int(time.time()) <= started:          # a second past the start, so the two differ
        time.sleep(0.05)
    for stream in (False, True):
        before = int(time.time())
        chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3, stream=stream)
        text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, stream=stream)
        after = int(time.time())
        for out in (chat, text):
            stamps = {chunk.created for chunk in out} if stream else {out.created}
            assert len(stamps) == 1, stamps
            assert before <= stamps.pop() <= after


def test_retrieve_model_by_id(client, server):
    """`client.models.retrieve(id)`: the entry /v1/models lists; an unknown id is a 404 in
    OpenAI's error shape."""
    [listed] = client.models.list().data
    model = client.models.retrieve(MODEL_NAME)
    assert model.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    r = httpx.get(server.url + "/v1/models/org/some-model", timeout=10)      # ids may hold slashes
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (404, "model", "NotFoundError")
    assert "org/some-model" in error["message"]


def test_the_log_names_the_address_it_listens_on(server):
    log = server.log_path.read_text()
    assert f"listening on {server.url}; /ready answers 200 once the model is loaded" in log, log[-2000:]
    assert f"serving {MODEL_NAME} (" in log and f") on {server.url}" in log, log[-2000:]
