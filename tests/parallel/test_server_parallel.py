"""`m3serve serve` with several ranks (gloo CPU processes): TP 2 and 4, EP 2 and 4, DP 2 + EP 2
answer the workload with the texts one in-process rank gives; a killed rank turns the server not-ready
and every request into a 503 within seconds, with the rank named; and one engine spread over
two "hosts" (two launchers on 127.0.0.1: --nnodes 2 --node-rank 0/1) answers the same."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from m3serve.llm import LLM
from serverutil import REPO_ROOT, LiveServer, free_port
from workload import LAYOUTS, assert_no_near_ties, engine_flags, layout_sizes, run, run_http


def _server_flags(tp: int, num_blocks: int) -> list[str]:
    f = engine_flags(tp, num_blocks)
    return ["--dtype", "float32", "--max-num-batched-tokens", str(f["max_num_batched_tokens"]),
            "--max-num-seqs", str(f["max_num_seqs"]), "--kv-cache-memory", str(f["kv_cache_memory"]),
            "--no-async-scheduling"]


def _layout_flags(flags: dict) -> list[str]:
    out = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


@pytest.fixture(scope="module")
def reference_texts(tiny_dir):
    llm = LLM(str(tiny_dir), **engine_flags())
    run(llm)
    assert_no_near_ties(llm)
    return run.texts


def _descendants(pid: int) -> list[int]:
    """Rank processes (spawned by multiprocessing) under `pid`, depth first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and b"multiprocessing.spawn" in _cmdline(entry):
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_server_equals_one_rank(tiny_dir, tmp_path, reference_texts, name):
    flags = LAYOUTS[name]
    tp, dp, blocks = layout_sizes(flags)
    log = tmp_path / f"{name}.log"
    srv = LiveServer(tiny_dir, *_layout_flags(flags), *_server_flags(tp, blocks), log_path=log)
    try:
        assert run_http(srv.url, data_parallel=dp > 1) == reference_texts
        m = srv.wait_idle()
        assert m["m3serve:num_preemptions_total"] > 0 and m["m3serve:prefix_cache_hits_total"] >= 32
        assert len(_descendants(srv.proc.pid)) == tp * dp      # one process per rank
        if dp > 1:
            _stop_with_requests_in_flight(srv)
    finally:
        srv.stop()
    assert "Traceback" not in log.read_text()
    assert "step failed" not in log.read_text()


def _stop_with_requests_in_flight(srv: LiveServer) -> None:
    """SIGTERM twice (the drain cut short) while both replicas stream: they leave together."""
    import threading

    started = threading.Event()

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": f"in flight {i}", "max_tokens": 300, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass                                 # the server went away under it: expected

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    assert started.wait(30)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=30) is not None
    for t in threads:
        t.join(timeout=10)


def test_killed_rank_turns_the_server_unavailable(tiny_dir, tmp_path):
    srv = LiveServer(tiny_dir, "-tp", "2", "--dtype", "float32", log_path=tmp_path / "kill.log")
    try:
        engine = next(p for p in _descendants(srv.proc.pid)
                      if _descendants(p))            # the engine process has the follower under it
        follower = _descendants(engine)[0]
        os.kill(follower, signal.SIGKILL)
        deadline = time.time() + 15
        while httpx.get(srv.url + "/ready", timeout=5).status_code != 503:
            assert time.time() < deadline, "the server stayed ready after a rank died"
            time.sleep(0.2)
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 503 and r.headers.get("retry-after")
        assert srv.proc.poll() is None                 # still answering, nothing hangs
        deadline = time.time() + 15
        while _descendants(srv.proc.pid):
            assert time.time() < deadline, "rank processes outlived the engine"
            time.sleep(0.2)
    finally:
        srv.stop()


def test_four_hosts(tiny_dir, tmp_path, reference_texts):
    """TP 2 x DP 2 over four launchers, one rank each: node 0 runs the API and replica 0's
    leader, node 1 that leader's follower, node 2 replica 1's leader (its engine reaches the API
    over TCP) and node 3 that one's follower."""
    master, rpc = free_port(), free_port(3)   # rpc: the output port, then one input port per replica
    common = ["--nnodes", "4", "--master-addr", "127.0.0.1", "--master-port", str(master),
              "--data-parallel-rpc-port", str(rpc), "-tp", "2", "-dp", "2", "--enable-expert-parallel",
              *_server_flags(2, 14)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    logs = [open(tmp_path / f"node{n}.log", "wb") for n in (1, 2, 3)]
    nodes = [subprocess.Popen([sys.executable, "-m", "m3serve", "serve", str(tiny_dir), "--node-rank", str(n),
                               *common], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
             for n, log in zip((1, 2, 3), logs)]
    try:
        srv = LiveServer(tiny_dir, "--node-rank", "0", *common, log_path=tmp_path / "node0.log")
        try:
            assert run_http(srv.url, data_parallel=True) == reference_texts
            srv.wait_idle()
        finally:
            srv.stop()
        for n, node in zip((1, 2, 3), nodes):      # the others end when node 0 shuts the engine down
            assert node.wait(timeout=30) == 0, (tmp_path / f"node{n}.log").read_text()[-3000:]
    finally:
        for node, log in zip(nodes, logs):
            if node.poll() is None:
                node.kill()
            log.close()
