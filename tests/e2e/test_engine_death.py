"""A killed engine process is visible at once: /health and /ready fail (so a liveness probe
restarts the server) and requests get a 503 naming the failure, never a 500."""
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from serverutil import MODEL_NAME, LiveServer

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")


def test_killed_engine_fails_health_and_requests_get_503(tiny_dir, tmp_path):
    server = LiveServer(tiny_dir, log_path=tmp_path / "server.log")
    try:
        pid = server.proc.pid
        children = map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
        [engine] = [c for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
        os.kill(engine, signal.SIGKILL)
        deadline = time.time() + 10
        while httpx.get(server.url + "/health", timeout=5).status_code != 503:
            assert time.time() < deadline, "/health still 200 after the engine died"
            time.sleep(0.1)
        assert httpx.get(server.url + "/ready", timeout=5).status_code == 503
        r = httpx.post(server.url + "/v1/completions", timeout=10,
                       json={"model": MODEL_NAME, "prompt": "anyone?", "max_tokens": 2})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"], r.text
        assert server.proc.poll() is None          # it stays up for the probe to see
    finally:
        server.stop()
