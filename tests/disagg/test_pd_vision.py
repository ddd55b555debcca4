"""Images through P/D on the tiny vision checkpoint (float32): the decode side's answer after
pulling the prompt's KV equals one server's, without encoding the images, and so does a decode
side whose pull fails and that computes the prompt itself, which it can because the request
carries its image to both sides."""
import sys
from pathlib import Path

import pytest
from pdutil import (F32_MARGIN, KEY, assert_clean, assert_same_greedy, decode_leg, greedy_reference, kv_flags, prefill_leg,
                    text_of, wait_steps_idle)
from serverutil import LiveServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))
from media_samples import data_url, png_bytes  # noqa: E402

ROUTE = "/v1/chat/completions"


@pytest.fixture(scope="module")
def servers(tiny_vision_dir, tmp_path_factory):
    flags = ("--api-key", KEY, "--dtype", "float32")
    servers = LiveServer.start_many(tiny_vision_dir, {
        # the hold outlives a decode leg on a loaded 2-core machine (4 s did not, once); the failed
        # pull's hold is freed by it, within assert_clean's 20 s
        "P": (*flags, *kv_flags("kv_producer", abort_request_timeout=10)),
        "D": (*flags, *kv_flags("kv_consumer")),
        "fail": (*flags, *kv_flags("kv_consumer", test_fault="fail", handshake_timeout=2)),
    }, tmp_path_factory.mktemp("pd-vision-logs"))
    yield servers
    for srv in servers.values():
        srv.stop()
    for srv in servers.values():
        assert "Traceback" not in srv.log_path.read_text(), srv.log_path.read_text()[-3000:]


def body(seed: int) -> dict:
    content = [{"type": "text", "text": "compare these two pictures carefully, block by block"},
               {"type": "image_url", "image_url": {"url": data_url(png_bytes(160, 120, seed=seed))}},
               {"type": "text", "text": "and"},
               {"type": "image_url", "image_url": {"url": data_url(png_bytes(90, 150, seed=seed + 1))}}]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("consumer", ["D", "fail"])
def test_decode_side_answers_as_one_server(servers, consumer):
    P, D = servers["P"], servers[consumer]
    b = body(seed=3)
    want = greedy_reference(P, ROUTE, b, margin=F32_MARGIN)
    before = D.metrics()
    params = prefill_leg(P, ROUTE, b)["kv_transfer_params"]
    wait_steps_idle(D)
    r = decode_leg(D, ROUTE, b, params)
    assert r.status_code == 200, r.text
    assert_same_greedy(text_of(r.json()), want, P, D, ROUTE, b)
    after = D.metrics()
    failed = consumer == "fail"
    assert after["m3serve:kv_transfer_fallbacks_total"] == before["m3serve:kv_transfer_fallbacks_total"] + failed
    # the pulled prompt's images are never encoded here; a fallback encodes both (it has their pixels)
    queries = "m3serve:mm_encoder_cache_queries_total"
    assert after[queries] - before[queries] == (2 if failed else 0)
    assert_clean(D)
    assert_clean(P)
