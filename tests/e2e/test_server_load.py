"""Large and many-prompt requests do not stall the server: /health answers promptly while a
huge chat is parsed and templated, and a request's prompt count is bounded."""
import json
import threading
import time

import httpx
import pytest
from serverutil import MODEL_NAME, LiveServer


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    srv = LiveServer(tiny_dir, log_path=tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


def test_health_answers_while_a_huge_chat_is_rendered(server):
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}] * 100_000,
                       "max_tokens": 1})
    latencies, done = [], threading.Event()

    def poll():
        while not done.is_set():
            t0 = time.perf_counter()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=120,
                   headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - t0
    done.set()
    poller.join(30)
    assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"]
    assert len(latencies) >= 5, (elapsed, latencies)
    # the event loop kept serving: no /health waited for the whole parse + render
    assert max(latencies) < max(0.5 * elapsed, 0.3), (elapsed, max(latencies))


def test_prompts_per_request_are_bounded(server):
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": MODEL_NAME, "prompt": ["x"] * 2000, "max_tokens": 1})
    assert r.status_code == 400 and "at most 1024 prompts per request" in r.json()["error"]["message"]
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"model": MODEL_NAME, "prompt": [f"p{i} hi" for i in range(300)], "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 300
    assert time.perf_counter() - t0 < 60


def test_a_huge_text_is_refused_before_tokenizing(server):
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "word " * 2_000_000, "max_tokens": 1})
    assert r.status_code == 400 and "characters cannot fit" in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 10
