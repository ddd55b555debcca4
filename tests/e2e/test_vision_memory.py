"""A running image request holds no pixels: while a 672 x 672 image's request streams (its
10.8 MB of float32 patches encoded), neither the API process nor the engine process keeps
Python objects of that size for it (tracemalloc, through the M3SERVE_DEBUG_TRACEMALLOC hook);
and /metrics counts the encoder-output cache: an image that returns after its request ended is
found there, not encoded again."""
import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from serverutil import MODEL_NAME, LiveServer

SIDE = 672                                 # the processor's default bound: 576 placeholder tokens
PIXEL_BYTES = (SIDE // 14) ** 2 * 1176 * 4      # [2304 patches, 1176] float32


def gradient_url(offset: int) -> str:
    """A smooth picture (a small PNG, so the request body stays small) of SIDE x SIDE."""
    ramp = (np.arange(SIDE)[:, None] + np.arange(SIDE)[None, :] + offset) % 256
    array = np.stack([ramp, ramp[::-1], np.full_like(ramp, offset)], axis=-1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def body(text: str, offset: int, **extra) -> dict:
    return {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True, **extra,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                      {"type": "image_url", "image_url": {"url": gradient_url(offset)}}]}]}


@pytest.fixture(scope="module")
def traced(tiny_vision_dir, tmp_path_factory):
    srv = LiveServer(tiny_vision_dir, "--dtype", "float32", env={"M3SERVE_DEBUG_TRACEMALLOC": "1"},
                     log_path=tmp_path_factory.mktemp("logs") / "vision_memory.log")
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log_path.read_text()


def traced_bytes(srv: LiveServer) -> tuple[int, int]:
    reading = httpx.get(srv.url + "/debug/tracemalloc", timeout=60).json()
    return reading["api"]["traced_bytes"], reading["engine_traced_bytes"][0]


def test_running_image_request_holds_no_pixels(traced):
    url = traced.url + "/v1/chat/completions"
    r = httpx.post(url, json=body("warm up on", 0, max_tokens=2), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > SIDE * SIDE // 28 ** 2
    traced.wait_idle()
    api_0, engine_0 = traced_bytes(traced)
    with httpx.stream("POST", url, json=body("now describe", 90, max_tokens=400, stream=True), timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        chunks = 0
        while chunks < 3:                    # the role chunk, then tokens: the prompt is computed
            chunks += next(lines).startswith("data: {")
        assert traced.metrics()["m3serve:num_requests_running"] == 1
        api_1, engine_1 = traced_bytes(traced)
    print(f"traced growth while the request ran: API {api_1 - api_0} B, engine {engine_1 - engine_0} B "
          f"(its pixels: {PIXEL_BYTES} B)")
    assert api_0 > 1_000_000 and engine_0 > 1_000_000     # tracing is on in both processes
    assert api_1 - api_0 < PIXEL_BYTES // 4
    assert engine_1 - engine_0 < PIXEL_BYTES // 4


def test_metrics_count_encoder_cache_hits(traced):
    url = traced.url + "/v1/chat/completions"
    before = traced.wait_idle()
    for text in ("first look at", "and again, another question about"):     # other text first: no prefix hit
        r = httpx.post(url, json=body(text, 180, max_tokens=2), timeout=120)
        assert r.status_code == 200, r.text
    after = traced.wait_idle()
    delta = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("m3serve:mm_encoder_cache")}
    assert delta["m3serve:mm_encoder_cache_queries_total"] == 2
    assert delta["m3serve:mm_encoder_cache_hits_total"] == 1
    assert delta["m3serve:mm_encoder_cache_evictions_total"] == 0
    assert after["m3serve:mm_encoder_cache_usage_bytes"] > 0        # kept for reuse within the bound
    text = httpx.get(traced.url + "/metrics", timeout=10).text
    assert "# TYPE m3serve:mm_encoder_cache_hits_total counter" in text
    assert "images and video: up to 1 GiB of vision-encoder outputs per rank" in traced.log_path.read_text()
