"""P/D when things go wrong, each ending with every request answered (or cleanly failed to its
client), no KV block leaked on either side (checked through /metrics) and both sides serving:
pulls that fail inside NIXL, pulls that stall past their timeout, a client that goes away while
its KV is being pulled or decoded, a prefill worker that is gone before the decode leg, and a
decode worker killed in the middle of a pull (the producer frees the held KV on its timeout).
The servers run in float32. Outputs are compared only on prompts whose greedy steps have no
near-tie (pdutil.F32_MARGIN), and only between computations batched alike: the reference and the
consumer's request each run alone on an idle server; a mismatch reports which side computes
differently (assert_same_greedy)."""
import os
import signal
import threading
import time

import httpx
import pytest
from pdutil import (HEADERS, assert_clean, assert_same_greedy, completion_body, decode_leg, greedy_reference,
                    pd_flags, post, prefill_leg, sse_text, text_of, wait_steps_idle)
from serverutil import LiveServer


@pytest.fixture(scope="module")
def faulty(tiny_dir, tmp_path_factory):
    servers = LiveServer.start_many(tiny_dir, {
        "fail": pd_flags("kv_consumer", test_fault="fail", handshake_timeout=2),
        "stall": pd_flags("kv_consumer", test_fault="stall", transfer_timeout=1.5),
        "P2": pd_flags("kv_producer"),
    }, tmp_path_factory.mktemp("fault-logs"))
    yield servers
    for srv in servers.values():
        srv.stop()


def _count(server, name):
    return server.metrics()[f"m3serve:{name}"]


@pytest.mark.parametrize("stream", [False, True])
def test_failed_pulls_are_recomputed(pd, faulty, stream):
    P, D = pd["P"], faulty["fail"]
    body = completion_body(seed=35 if stream else 21)
    want = greedy_reference(P, "/v1/completions", body)
    before = (_count(D, "kv_transfer_fallbacks_total"), _count(D, "kv_transfer_failed_pulls_total"))
    params = prefill_leg(P, "/v1/completions", body)["kv_transfer_params"]
    wait_steps_idle(D)
    r = decode_leg(D, "/v1/completions", {**body, "stream": stream}, params)
    assert r.status_code == 200
    assert_same_greedy(sse_text(r) if stream else text_of(r.json()), want, P, D, "/v1/completions", body)
    assert (_count(D, "kv_transfer_fallbacks_total"), _count(D, "kv_transfer_failed_pulls_total")) == \
        (before[0] + 1, before[1] + 1)
    assert "NIXL" in D.log_path.read_text()        # the failure came from the transport
    assert_clean(D)
    assert_clean(P)                                # the consumer released the producer's copy


def test_stalled_pull_times_out_and_is_recomputed(pd, faulty):
    P, D = pd["P"], faulty["stall"]
    body = completion_body(seed=101)
    want = greedy_reference(P, "/v1/completions", body)
    params = prefill_leg(P, "/v1/completions", body)["kv_transfer_params"]
    wait_steps_idle(D)
    start = time.time()
    r = decode_leg(D, "/v1/completions", body, params)
    assert r.status_code == 200
    assert_same_greedy(text_of(r.json()), want, P, D, "/v1/completions", body)
    assert time.time() - start >= 1.5
    assert "timed out" in D.log_path.read_text()
    assert_clean(D)
    assert_clean(P)


def test_client_gone_while_pulling(pd, faulty):
    P, D = pd["P"], faulty["stall"]
    body = completion_body(seed=320)
    params = prefill_leg(P, "/v1/completions", body)["kv_transfer_params"]
    with pytest.raises(httpx.ReadTimeout):
        decode_leg(D, "/v1/completions", body, params, timeout=0.6)
    # the aborted request's blocks wait for the pull to end (its timeout), then everything is free
    assert_clean(D)
    assert_clean(P)
    assert post(D, "/v1/completions", completion_body(seed=321, max_tokens=3)).status_code == 200


def test_client_gone_while_decoding(pd):
    P, D = pd["P"], pd["D"]
    body = completion_body(seed=330, max_tokens=200, stream=True)
    params = prefill_leg(P, "/v1/completions", body)["kv_transfer_params"]
    with httpx.stream("POST", D.url + "/v1/completions", json={**body, "kv_transfer_params": params},
                      headers=HEADERS, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break                              # first token arrived: hang up
    assert_clean(D)
    assert_clean(P)


def test_prefill_worker_gone_before_the_decode_leg(pd, faulty):
    P2, D = faulty["P2"], faulty["fail"]
    body = completion_body(seed=110)
    want = greedy_reference(P2, "/v1/completions", body)
    params = prefill_leg(P2, "/v1/completions", body)["kv_transfer_params"]
    P2.stop()
    wait_steps_idle(D)
    r = decode_leg(D, "/v1/completions", body, params)
    assert r.status_code == 200                                    # computed on the decode side
    assert_same_greedy(text_of(r.json()), want, None, D, "/v1/completions", body)
    assert_clean(D)


def test_decode_worker_killed_mid_pull(pd, faulty):
    P, D = pd["P"], faulty["stall"]
    body = completion_body(seed=350)
    params = prefill_leg(P, "/v1/completions", body)["kv_transfer_params"]
    errors = []

    def client():
        try:
            decode_leg(D, "/v1/completions", body, params, timeout=30)
        except httpx.HTTPError as e:
            errors.append(e)

    t = threading.Thread(target=client)
    t.start()
    deadline = time.time() + 10
    while _count(D, "kv_transfer_active_pulls") < 1:
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(D.proc.pid, signal.SIGKILL)
    t.join(30)
    assert errors                                  # the client sees the connection go
    assert P.metrics()["m3serve:kv_transfer_held_blocks"] > 0
    m = assert_clean(P, timeout_s=20)              # freed by the producer's hold timeout
    assert m["m3serve:kv_transfer_holds_expired_total"] >= 1
    assert post(P, "/v1/completions", completion_body(seed=351, max_tokens=3)).status_code == 200
