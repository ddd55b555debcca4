"""`m3serve serve --kv-offloading-size`: a session's second turn, its first turn pushed out of a
small GPU pool by other prompts, comes back from the CPU tier; the response counts the restored
tokens as cached, and /metrics counts exactly the blocks that travelled."""
import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from serverutil import LiveServer

BYTES_PER_TOKEN = 2944          # fp32 tiny model: main K/V + index keys


def _ids(n, seed):
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _metrics(url) -> dict:
    text = httpx.get(url + "/metrics", params={}, timeout=10).text
    return {(s.name, s.labels.get("direction")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("m3serve:")}


def test_second_turn_restored_from_the_tier(tiny_dir, tmp_path):
    tier_gib = 64 * 16 * BYTES_PER_TOKEN / (1 << 30)
    server = LiveServer(tiny_dir, "--dtype", "float32", "--kv-cache-memory", str(14 * 16 * BYTES_PER_TOKEN),
                        "--max-num-batched-tokens", "32", "--kv-offloading-size", repr(tier_gib),
                        "--kv-offloading-backend", "native", "--metric-names", "m3serve",
                        log_path=tmp_path / "server.log")
    try:
        def complete(prompt):
            r = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        first = _ids(100, 51)
        complete(first)
        complete(_ids(120, 52))
        complete(_ids(110, 53))
        second = complete(first + _ids(12, 54))
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        m = _metrics(server.url)
        assert m[("m3serve:external_prefix_cache_hits_total", None)] == 96         # 6 blocks of 16
        assert m[("m3serve:external_prefix_cache_queries_total", None)] == m[("m3serve:prefix_cache_queries_total", None)]
        assert m[("m3serve:kv_offload_bytes_total", "to_gpu")] == 96 * BYTES_PER_TOKEN
        assert m[("m3serve:kv_offload_bytes_total", "to_cpu")] >= 96 * BYTES_PER_TOKEN
        assert m[("m3serve:kv_offload_seconds_total", "to_gpu")] > 0
        assert 0 < m[("m3serve:kv_offload_usage_perc", None)] <= 1
    finally:
        server.stop()
