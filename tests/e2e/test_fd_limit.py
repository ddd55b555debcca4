"""The open-file limit: raised to the hard limit at start and logged, a warning when it is
short, and a connection flood past it refused while the server keeps serving."""
import resource
import socket
import time

import httpx
from serverutil import MODEL_NAME, LiveServer

SOFT, HARD = 200, 320


def low_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, HARD))


def test_limit_raised_logged_and_a_flood_refused_not_fatal(tiny_dir, tmp_path):
    server = LiveServer(tiny_dir, "--max-num-seqs", "8", "--max-waiting-requests", "64",
                        log_path=tmp_path / "server.log", preexec_fn=low_limit)
    flood = []
    try:
        log = server.log_path.read_text()
        assert f"open-file limit: {HARD} (hard {HARD})" in log, log[-2000:]
        assert f"open-file limit {HARD} is below the {8 + 64 + 256}" in log
        for _ in range(2 * HARD):                     # more connections than the server has files
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", server.port))
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")      # never finished
            except OSError:
                pass
            flood.append(s)
        time.sleep(1.0)
        assert server.proc.poll() is None, "the server died under the flood"
        for s in flood:
            s.close()
        flood.clear()
        deadline = time.time() + 30
        while True:           # accepting resumes once descriptors are free again
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, server.log_path.read_text()[-2000:]
            time.sleep(0.2)
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": MODEL_NAME, "prompt": "still here", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        for s in flood:
            s.close()
        server.stop()
