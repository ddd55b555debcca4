"""m3serve workers behind the routers people run (pip-installed vllm-router and smg, started with
`m3serve route`): in P/D mode the router runs the prefill leg on the producer and the decode leg
on the consumer, and what the client gets equals one server's answer, streamed or not, for
completions and chat; the KV really moves (the consumer's pull counter grows). In plain mode the
routers' probes (cache_aware's render/tokenize, power_of_two's /get_load) are answered and
requests go through. Prompts are fixed, and compared ones have no near-tied greedy step
(pdutil.F32_MARGIN; the servers run in float32)."""
import shutil

import pytest
from pdutil import (KEY, RouterProc, assert_clean, assert_same_greedy, chat_body, completion_body, greedy_reference,
                    post, sse_text, text_of, wait_steps_idle)

pytestmark = pytest.mark.skipif(not (shutil.which("vllm-router") and shutil.which("smg")),
                                reason="needs vllm-router and smg (pip install vllm-router smg)")

CASES = [("/v1/completions", completion_body, False), ("/v1/completions", completion_body, True),
         ("/v1/chat/completions", chat_body, False), ("/v1/chat/completions", chat_body, True)]
SEEDS = {("vllm-router", "/v1/completions"): (142, 151), ("smg", "/v1/completions"): (163, 207),
         ("vllm-router", "/v1/chat/completions"): (89, 145), ("smg", "/v1/chat/completions"): (170, 178)}


@pytest.fixture(scope="module")
def pd_routers(pd, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-logs")
    P, D = pd["P"], pd["D"]
    routers = {}
    try:
        routers["vllm-router"] = RouterProc(logs / "vllm-router.log", "--router", "vllm-router",
                                            "--prefill", P.url, "--decode", D.url, "--worker-api-key", KEY)
        routers["smg"] = RouterProc(logs / "smg.log", "--router", "smg", "--prefill", P.url, "--decode", D.url,
                                    "--manifest", str(logs / "workers.json"), "--worker-api-key", KEY)
        yield routers
    finally:
        for r in routers.values():
            r.stop()


@pytest.mark.parametrize("router", ["vllm-router", "smg"])
@pytest.mark.parametrize("route, make, stream", CASES)
def test_pd_through_router_equals_one_server(pd, pd_routers, router, route, make, stream):
    P, D = pd["P"], pd["D"]
    body = make(seed=SEEDS[router, route][stream])
    want = greedy_reference(P, route, body)
    before = D.metrics()["m3serve:kv_transfer_pulls_total"]
    wait_steps_idle(D)
    r = post(pd_routers[router], route, {**body, "stream": stream})
    assert r.status_code == 200, r.text
    assert_same_greedy(sse_text(r) if stream else text_of(r.json()), want, P, D, route, body)
    assert D.metrics()["m3serve:kv_transfer_pulls_total"] == before + 1     # the prompt's KV was pulled


@pytest.mark.parametrize("router", ["vllm-router", "smg"])
def test_no_leaks_after_routed_traffic(pd, pd_routers, router):
    post(pd_routers[router], "/v1/completions", completion_body(seed=77, max_tokens=4))
    assert_clean(pd["P"])
    assert_clean(pd["D"])


@pytest.mark.parametrize("router, policy", [("vllm-router", "cache_aware"), ("smg", "power_of_two"),
                                            ("vllm-router", "power_of_two")])
def test_plain_mode_behind_routers(pd, tmp_path, router, policy):
    P, D = pd["P"], pd["D"]
    proc = RouterProc(tmp_path / f"{router}-{policy}.log", "--router", router, "--policy", policy,
                      "--worker", P.url, D.url, "--worker-api-key", KEY)
    try:
        for seed in (73, 84, 120):
            body = completion_body(seed=seed, max_tokens=6)
            r = post(proc, "/v1/completions", body)
            assert r.status_code == 200, r.text
            assert text_of(r.json()) == greedy_reference(P, "/v1/completions", body)
        r = post(proc, "/v1/chat/completions", {**chat_body(seed=4, max_tokens=6), "stream": True})
        assert r.status_code == 200 and sse_text(r)
    finally:
        proc.stop()
