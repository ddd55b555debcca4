"""Graceful drain of `m3serve serve` on SIGTERM/SIGINT: /ready turns 503 at once, new requests
get 503 with Retry-After, running ones finish (or are aborted after --shutdown-timeout), the
engine processes exit and the server exits 0; a second signal exits at once."""
import json
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from serverutil import MODEL_NAME, LiveServer

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")


def descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            out.add(k)
            todo.append(k)
    return out


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(pid)
    return left


class Stream(threading.Thread):
    """A streaming completion read to its end in the background."""

    def __init__(self, server, max_tokens: int):
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.first = threading.Event()
        self.events, self.status, self.broken = [], None, None

    def run(self):
        try:
            self._read()
        except httpx.HTTPError as e:           # the server went away mid-stream
            self.broken = e
        self.first.set()

    def _read(self):
        body = {"model": MODEL_NAME, "prompt": "a long answer", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.server.url + "/v1/completions", json=body, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.events.append(json.loads(line[6:]))
                    self.first.set()

    def tokens(self) -> int:
        return sum(1 for e in self.events for c in e.get("choices", []))


@contextmanager
def streaming_server(tiny_dir, tmp_path, timeout_s: float, max_tokens: int):
    """A server with --shutdown-timeout `timeout_s` and one stream of `max_tokens` under way:
    (server, its descendant processes, the stream); the server is stopped at the end."""
    server = LiveServer(tiny_dir, "--shutdown-timeout", str(timeout_s), "--uvicorn-log-level", "info",
                        log_path=tmp_path / "server.log")
    try:
        children = descendants(server.proc.pid)
        stream = Stream(server, max_tokens)
        stream.start()
        assert stream.first.wait(60)
        yield server, children, stream
    finally:
        server.stop()


def test_sigterm_lets_running_requests_finish_and_refuses_new_ones(tiny_dir, tmp_path):
    # 400 tokens: the stream must outlast the probes below (a 40-token one could finish, and the
    # drained server exit, within the 0.3 s before the first probe on a fast step)
    with streaming_server(tiny_dir, tmp_path, 60, 400) as (server, children, stream):
        assert children, "the engine runs in a child process"
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert httpx.get(server.url + "/ready", timeout=5).status_code == 503
        refused = httpx.post(server.url + "/v1/completions", timeout=5,
                             json={"model": MODEL_NAME, "prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers.get("retry-after") == "1"
        assert "shutting down" in refused.json()["error"]["message"]
        assert server.proc.wait(timeout=60) == 0
        stream.join(5)
        assert stream.status == 200 and stream.tokens() == 400
        assert stream.events[-1]["choices"][0]["finish_reason"] == "length"
        log = server.log_path.read_text()
        assert "0 sequence(s) aborted, KV blocks in use: 0" in log, log[-2000:]
        deadline = time.time() + 10
        while alive(children) and time.time() < deadline:
            time.sleep(0.1)
        assert not alive(children), "engine processes outlived the server"


def test_requests_past_the_timeout_are_aborted_and_freed(tiny_dir, tmp_path):
    with streaming_server(tiny_dir, tmp_path, 1, 3000) as (server, _, stream):
        t0 = time.time()
        server.proc.send_signal(signal.SIGINT)              # SIGINT once drains like SIGTERM
        assert server.proc.wait(timeout=30) == 0
        assert time.time() - t0 < 20
        stream.join(5)
        errors = [e["error"] for e in stream.events if "error" in e]
        assert errors and "shutting down" in errors[0]["message"] and errors[0]["code"] == 503, stream.events[-2:]
        assert stream.tokens() < 3000
        log = server.log_path.read_text()
        assert "1 sequence(s) aborted, KV blocks in use: 0" in log, log[-2000:]


def test_a_second_signal_exits_at_once(tiny_dir, tmp_path):
    with streaming_server(tiny_dir, tmp_path, 120, 3000) as (server, _, stream):
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.proc.poll() is None                  # draining: the stream still runs
        t0 = time.time()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=15) == 1
        assert time.time() - t0 < 10
        stream.join(5)
        assert stream.broken is not None or stream.tokens() < 3000
