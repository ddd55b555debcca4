"""The vLLM NIXL protocol between two m3serve workers, without a router: a prefill leg on the
producer, then the decode leg on the consumer with the producer's kv_transfer_params, for
completions and chat, streamed and not. The consumer's greedy output must equal one server's
(the producer answering the whole request), token for token, on prompts long enough that the
sparse layers' block selection reads the pulled index cache; a consumer that skips the index
cache while pulling gets other tokens, which shows the comparison would catch it. Prompts are
fixed, and compared ones have no near-tied greedy step (pdutil.F32_MARGIN; the servers run in
float32)."""
import concurrent.futures as cf

import httpx
import pytest
from pdutil import (HEADERS, assert_clean, assert_same_greedy, chat_body, completion_body, decode_leg, greedy_gaps,
                    greedy_reference, pd_flags, post, prefill_leg, sse_text, text_of, wait_steps_idle)
from serverutil import LiveServer

ROUTES = [("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)]
SEEDS = {("/v1/completions", False): 114, ("/v1/completions", True): 126,
         ("/v1/chat/completions", False): 49, ("/v1/chat/completions", True): 88}


def reference(p, route, body):
    r = post(p, route, body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("route, make", ROUTES)
@pytest.mark.parametrize("stream", [False, True])
def test_decode_leg_equals_one_server(pd, route, make, stream):
    P, D = pd["P"], pd["D"]
    body = make(seed=SEEDS[route, stream])
    want = greedy_reference(P, route, body)
    before = D.metrics()
    pre = prefill_leg(P, route, body)
    params = pre["kv_transfer_params"]
    assert len(params["remote_block_ids"]) == -(-pre["usage"]["prompt_tokens"] // 16)
    assert pre["usage"]["prompt_tokens"] > 4 * 16 * 4      # far beyond what sparse layers keep
    wait_steps_idle(D)
    r = decode_leg(D, route, {**body, "stream": stream}, params)
    assert r.status_code == 200, r.text
    assert_same_greedy(sse_text(r) if stream else text_of(r.json()), want, P, D, route, body)
    after = D.metrics()
    assert after["m3serve:kv_transfer_pulls_total"] == before["m3serve:kv_transfer_pulls_total"] + 1
    assert after["m3serve:kv_transfer_fallbacks_total"] == before["m3serve:kv_transfer_fallbacks_total"]
    # every block of the prompt but the prefix cache's came over
    assert after["m3serve:nixl_bytes_transferred_total"] > before["m3serve:nixl_bytes_transferred_total"]


def test_concurrent_pairs(pd):
    P, D = pd["P"], pd["D"]
    bodies = [completion_body(seed=seed, max_tokens=8) for seed in (23, 37, 44, 53, 54, 72)]
    want = [greedy_reference(P, "/v1/completions", b) for b in bodies]   # one at a time: batched otherwise

    def pair(body):
        pre = prefill_leg(P, "/v1/completions", body)
        return text_of(decode_leg(D, "/v1/completions", body, pre["kv_transfer_params"]).json())

    with cf.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(pair, bodies)) == want
    assert_clean(P)
    assert_clean(D)


def test_prefill_leg_answers_the_routers_shape(pd):
    P = pd["P"]
    pre = prefill_leg(P, "/v1/completions", completion_body(seed=7))
    params = pre["kv_transfer_params"]
    assert set(params) >= {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                           "remote_request_id", "remote_host", "remote_port", "tp_size"}
    assert params["do_remote_decode"] is False and params["tp_size"] == 1
    assert params["remote_host"] == "localhost" and params["remote_port"] > 0
    # nobody pulls it: the hold ends after the producer's 4 s timeout
    assert P.metrics()["m3serve:kv_transfer_held_blocks"] >= len(params["remote_block_ids"])
    m = assert_clean(P, timeout_s=15)
    assert m["m3serve:kv_transfer_holds_expired_total"] >= 1


@pytest.mark.parametrize("params, message", [
    ("garbage", "kv_transfer_params"),
    ({"do_remote_prefill": True}, "needs remote_block_ids"),
    ({"do_remote_prefill": True, "remote_block_ids": "1,2", "remote_engine_id": "e", "remote_request_id": "r",
      "remote_host": "localhost", "remote_port": 1}, "remote_block_ids"),
    ({"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "e", "remote_request_id": "r",
      "remote_host": "localhost", "remote_port": 99999}, "remote_port"),
])
def test_garbage_params_are_a_400(pd, params, message):
    r = post(pd["D"], "/v1/completions", {**completion_body(seed=1), "kv_transfer_params": params})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_stale_and_foreign_params_are_a_400(pd):
    P, D = pd["P"], pd["D"]
    body = completion_body(seed=11, max_tokens=4)
    params = prefill_leg(P, "/v1/completions", body)["kv_transfer_params"]
    assert decode_leg(D, "/v1/completions", body, params).status_code == 200
    # replayed after the pull: the producer no longer holds it
    r = decode_leg(D, "/v1/completions", body, params)
    assert r.status_code == 400 and "stale" in r.json()["error"]["message"]
    # another prompt than the one prefilled
    params = prefill_leg(P, "/v1/completions", body)["kv_transfer_params"]
    other = completion_body(seed=12, max_tokens=4)
    r = decode_leg(D, "/v1/completions", other, params)
    assert r.status_code == 400 and "another prompt" in r.json()["error"]["message"]
    r = decode_leg(D, "/v1/completions", other, {**params, "prompt_hash": None})   # the producer checks too
    assert r.status_code == 400 and "prompt differs" in r.json()["error"]["message"]
    for wrong in ({"remote_engine_id": "someone-else"}, {"remote_block_ids": params["remote_block_ids"][:-1]},
                  {"remote_request_id": "cmpl-unknown"}):
        r = decode_leg(D, "/v1/completions", body, {**params, **wrong})
        assert r.status_code == 400, r.text
    assert decode_leg(D, "/v1/completions", body, params).status_code == 200    # the real one still works


def test_legs_need_the_right_role_and_shape(pd):
    P, D = pd["P"], pd["D"]
    r = post(D, "/v1/completions", {**completion_body(seed=2), "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "not a KV producer" in r.json()["error"]["message"]
    params = prefill_leg(P, "/v1/completions", completion_body(seed=3))["kv_transfer_params"]
    r = decode_leg(P, "/v1/completions", completion_body(seed=3), params)
    assert r.status_code == 400 and "not a KV consumer" in r.json()["error"]["message"]
    r = decode_leg(D, "/v1/completions", completion_body(seed=3, n=2, temperature=1.0), params)
    assert r.status_code == 400 and "n = 1" in r.json()["error"]["message"]
    r = decode_leg(D, "/v1/completions", {**completion_body(seed=3), "prompt": ["a b", "c d"]}, params)
    assert r.status_code == 400 and "exactly one prompt" in r.json()["error"]["message"]
    assert decode_leg(D, "/v1/completions", completion_body(seed=3), params).status_code == 200


def test_workers_keep_their_api_key(pd):
    r = post(pd["D"], "/v1/completions", completion_body(seed=1), headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = post(pd["P"], "/v1/completions", completion_body(seed=1), headers={})
    assert r.status_code == 401


def test_router_probes(pd):
    P = pd["P"]
    assert httpx.get(P.url + "/version").json()["version"]
    assert isinstance(httpx.get(P.url + "/get_load").json()["load"], int)
    loads = httpx.get(P.url + "/v1/loads?include=core,disagg,queues,memory", headers=HEADERS).json()
    assert loads["dp_rank_count"] == 1 and loads["loads"][0]["disagg_mode"] == "prefill"
    assert loads["loads"][0]["max_total_num_tokens"] > 0
    body = completion_body(seed=5)
    render = post(P, "/v1/completions/render", body).json()
    tokens = post(P, "/tokenize", {"model": "tiny", "prompt": body["prompt"]}).json()["tokens"]
    assert render[0]["token_ids"] == tokens
    chat = post(P, "/v1/chat/completions/render", chat_body(seed=5)).json()
    assert chat["token_ids"] and isinstance(chat["prompt"], str)
    assert post(P, "/v1/completions/render", body, headers={}).status_code == 401


def test_missing_index_cache_changes_the_output(pd, tiny_dir, tmp_path):
    """The negative control: pull everything but the index cache and the decode goes wrong."""
    P = pd["P"]
    broken = LiveServer(tiny_dir, *pd_flags("kv_consumer", test_fault="skip_index"),
                        log_path=tmp_path / "no-index.log")
    try:
        differ = 0
        for seed in (900, 901, 902):
            body = completion_body(seed=seed, max_tokens=16)
            want = text_of(reference(P, "/v1/completions", body))
            params = prefill_leg(P, "/v1/completions", body)["kv_transfer_params"]
            got = text_of(decode_leg(broken, "/v1/completions", body, params).json())
            differ += got != want
        assert differ >= 2, "pulling without the index cache went unnoticed"
        assert_clean(broken)
    finally:
        broken.stop()
    assert_clean(P)


def test_near_tied_references_are_refused(pd):
    """The guard of the comparisons above: seed 95's prompt (test_pd_faults's stalled pull, which
    failed once in bf16) has a greedy step whose two best logits tie in float32."""
    with pytest.raises(AssertionError, match="near-ties"):
        greedy_reference(pd["P"], "/v1/completions", completion_body(seed=95))


def test_greedy_gaps_in_both_formats():
    chat = {"choices": [{"logprobs": {"content": [
        {"logprob": -0.5, "top_logprobs": [{"logprob": -0.5}, {"logprob": -0.75}, {"logprob": -2.0}]},
        {"logprob": -1.0, "top_logprobs": [{"logprob": -1.0}, {"logprob": -1.0}]}]}}]}
    assert greedy_gaps("/v1/chat/completions", chat) == [0.25, 0.0]
    five = {"a": -0.5, "b": -1.25, "c": -2.0, "d": -3.0, "e": -4.0}
    cmpl = {"choices": [{"logprobs": {
        "tokens": ["a", "a", "\ufffd", "\ufffd"], "token_logprobs": [-0.5, -0.5, -1.0, -1.0],
        "top_logprobs": [five,
                         {"a": -0.5, "b": -1.25, "c": -2.0},            # c merged d and e: not into "a"
                         {"\ufffd": -1.0, "x": -2.0, "y": -3.0},        # merged, maybe the runner-up
                         {"\ufffd": -1.0, "x": -1.5, "y": -3.0, "z": -4.0, "w": -5.0}]}}]}
    assert greedy_gaps("/v1/completions", cmpl) == [0.75, 0.75, 0.0, 0.5]
