"""P/D between workers of different tensor-parallel sizes (gloo CPU ranks, float32 so that TP
layouts agree to the token): a TP 2 producer feeds a TP 1 consumer (each consumer rank pulls
both heads' halves from two producer ranks), a TP 1 producer feeds a TP 2 consumer (each rank
pulls its head from the one producer rank, and both ranks must report before decode starts),
and TP 2 feeds TP 2; directly and behind vllm-router. Outputs equal one TP 1 server's, on
prompts whose greedy steps lead by more than TP's rounding differences (pdutil.F32_MARGIN)."""
import shutil

import pytest
from pdutil import (F32_MARGIN, KEY, RouterProc, assert_clean, assert_same_greedy, completion_body, decode_leg,
                    greedy_reference, kv_flags, post, prefill_leg, text_of, wait_steps_idle)
from serverutil import LiveServer

F32 = ("--dtype", "float32", "--api-key", KEY)


@pytest.fixture(scope="module")
def tp_pd(tiny_dir, tmp_path_factory):
    servers = LiveServer.start_many(tiny_dir, {
        "P1": (*F32, *kv_flags("kv_producer")),
        "D1": (*F32, *kv_flags("kv_consumer")),
        "P2": (*F32, "-tp", "2", *kv_flags("kv_producer")),
        "D2": (*F32, "-tp", "2", *kv_flags("kv_consumer")),
    }, tmp_path_factory.mktemp("tp-logs"))
    try:
        yield servers
        for srv in servers.values():
            assert_clean(srv)
    finally:
        for srv in servers.values():
            srv.stop()


@pytest.mark.parametrize("producer, consumer, seeds", [("P2", "D1", (404, 405)), ("P1", "D2", (406, 408)),
                                                      ("P2", "D2", (409, 411))])
def test_pd_across_tp_sizes(tp_pd, producer, consumer, seeds):
    P, D = tp_pd[producer], tp_pd[consumer]
    for seed in seeds:
        body = completion_body(seed=seed, max_tokens=10)
        want = greedy_reference(tp_pd["P1"], "/v1/completions", body, margin=F32_MARGIN)
        pre = prefill_leg(P, "/v1/completions", body)
        assert pre["kv_transfer_params"]["tp_size"] == (2 if producer == "P2" else 1)
        before = D.metrics()["m3serve:kv_transfer_pulls_total"]
        wait_steps_idle(D)
        r = decode_leg(D, "/v1/completions", body, pre["kv_transfer_params"])
        assert r.status_code == 200
        assert_same_greedy(text_of(r.json()), want, tp_pd["P1"], D, "/v1/completions", body)
        assert D.metrics()["m3serve:kv_transfer_pulls_total"] == before + 1


@pytest.mark.skipif(not shutil.which("vllm-router"), reason="needs vllm-router")
def test_tp2_producer_behind_vllm_router(tp_pd, tmp_path):
    router = RouterProc(tmp_path / "router.log", "--router", "vllm-router", "--prefill", tp_pd["P2"].url,
                        "--decode", tp_pd["D1"].url, "--worker-api-key", KEY)
    try:
        body = completion_body(seed=412, max_tokens=10)
        want = greedy_reference(tp_pd["P1"], "/v1/completions", body, margin=F32_MARGIN)
        assert text_of(post(router, "/v1/completions", body).json()) == want
    finally:
        router.stop()
