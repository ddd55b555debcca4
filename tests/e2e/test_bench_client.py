"""The bench client against a fake OpenAI-compatible streaming server with known delays.

The fake server (FastAPI + uvicorn, in a child process on a free 127.0.0.1 port) records when
it received each request and when it sent each token chunk; those timestamps and its configured
delays are the independent measurements that the client's TTFT and TPOT must agree with.
"""
import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from m3serve.bench import serve, sweep
from m3serve.bench.datasets import sample_random_requests


class FakeServer:
    """Streams `max_tokens` chunks of one token each: first after `ttft_s`, then every `itl_s`,
    then a finish chunk, a usage chunk and [DONE]. Every `fail_every`-th request gets HTTP 500.
    POST /_reset sets the delays and clears the log; GET /_log returns it."""

    def __init__(self):
        self.ttft_s, self.itl_s, self.fail_every, self.root = 0.1, 0.02, 0, None
        self.num_requests = 0
        self.timings: list[tuple[float, list[float]]] = []  # (received, chunk send times)
        self.prompts: list[str] = []
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat)
        self.app.post("/_reset")(self.reset)
        self.app.get("/_log")(self.log)

    async def reset(self, request: Request):
        body = await request.json()
        self.ttft_s, self.itl_s = body["ttft_s"], body["itl_s"]
        self.fail_every = body.get("fail_every", 0)
        self.root = body.get("root")
        self.num_requests = 0
        self.timings = []
        self.prompts = []
        return {}

    async def log(self):
        return {"num_requests": self.num_requests, "timings": self.timings, "prompts": self.prompts}

    async def models(self):
        return {"object": "list", "data": [{"id": "fake-model", "object": "model",
                                             **({"root": self.root} if self.root else {})}]}

    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    async def chat(self, request: Request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool):
        received = time.perf_counter()
        body = await request.json()
        self.num_requests += 1
        if self.fail_every and self.num_requests % self.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        num_tokens = body.get("max_completion_tokens") or body["max_tokens"]
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        self.prompts.append(body["messages"][0]["content"] if chat else body["prompt"])
        prompt_len = len(self.prompts[-1])

        def event(choice):
            return f"data: {json.dumps({'id': 'x', 'choices': [choice] if choice else []})}\n\n"

        def token_choice(text):
            return {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}

        async def stream():
            sends = []
            if chat:  # role-only first chunk: carries no text, must not count as the first token
                yield event({"index": 0, "delta": {"role": "assistant", "content": ""}})
            await asyncio.sleep(self.ttft_s)
            for i in range(num_tokens):
                if i:
                    await asyncio.sleep(self.itl_s)
                sends.append(time.perf_counter())
                yield event(token_choice(f" t{i}"))
            self.timings.append((received, sends))  # before [DONE], so the client sees it
            yield event({"index": 0, "finish_reason": "length",
                         **({"delta": {}} if chat else {"text": ""})})
            if include_usage:
                usage = {"prompt_tokens": prompt_len, "completion_tokens": num_tokens,
                         "total_tokens": prompt_len + num_tokens}
                yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


def _serve_on_fd(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    uvicorn.Server(uvicorn.Config(FakeServer().app, log_level="warning",
                                  lifespan="off")).run(sockets=[sock])


class FakeClient:
    """Test-side handle on the fake server process."""

    def __init__(self, base_url: str):
        self.base_url = base_url

    def reset(self, ttft_s, itl_s, fail_every=0, root=None):
        httpx.post(self.base_url + "/_reset",
                   json={"ttft_s": ttft_s, "itl_s": itl_s, "fail_every": fail_every, "root": root})

    @property
    def num_requests(self) -> int:
        return httpx.get(self.base_url + "/_log").json()["num_requests"]

    @property
    def timings(self) -> list:
        return httpx.get(self.base_url + "/_log").json()["timings"]

    @property
    def prompts(self) -> list[str]:
        return httpx.get(self.base_url + "/_log").json()["prompts"]


@pytest.fixture(scope="module")
def fake():
    # Its own process, so that the server's work does not share the client's GIL and skew the
    # client's timings on a busy machine.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; import test_bench_client as t; "
            "t._serve_on_fd(int(sys.argv[3]))")
    repo_root = os.path.dirname(os.path.dirname(here))
    proc = subprocess.Popen([sys.executable, "-c", code, here, repo_root, str(sock.fileno())],
                            pass_fds=[sock.fileno()])
    client = FakeClient(f"http://127.0.0.1:{port}")
    deadline = time.time() + 30
    while True:
        try:
            httpx.get(client.base_url + "/v1/models", timeout=1.0).raise_for_status()
            break
        except httpx.HTTPError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("fake server did not start")
            time.sleep(0.05)
    yield client
    proc.terminate()
    proc.wait(timeout=10)
    sock.close()


class _WordTokenizer:
    """Any-object tokenizer: one token per letter, enough for the client's prompts."""

    vocab_size = 26

    def encode(self, text):
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def _tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["alpha beta gamma delta"] * 50, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path)


def test_ttft_tpot_agree_with_server_timestamps(fake):
    fake.reset(ttft_s=0.25, itl_s=0.025)
    requests = sample_random_requests(_WordTokenizer(), 8, 40, 8, 0.5, "inferencex", seed=0)
    warmups = sample_random_requests(_WordTokenizer(), 4, 40, 2, 1.0, seed=9)
    result = asyncio.run(serve.benchmark(
        api_url=fake.base_url + "/v1/completions", model="fake-model", requests=requests,
        warmup_requests=warmups, max_concurrency=4, disable_tqdm=True, show_summary=False))
    timings = fake.timings[len(warmups):]
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["output_lens"] == [r.expected_output_len for r in requests]
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in requests)
    assert result["total_input_tokens"] == sum(r.prompt_len for r in requests)

    server_ttfts = [sends[0] - received for received, sends in timings]
    server_tpots = [(s[-1] - s[0]) / (len(s) - 1) for _, s in timings if len(s) > 1]
    assert result["mean_ttft_ms"] == pytest.approx(1000 * np.mean(server_ttfts), rel=0.10)
    assert result["median_tpot_ms"] == pytest.approx(1000 * np.median(server_tpots), rel=0.10)
    # and with the configured delays themselves
    assert result["mean_ttft_ms"] == pytest.approx(250.0, rel=0.10)
    assert result["median_tpot_ms"] == pytest.approx(25.0, rel=0.10)
    assert result["median_itl_ms"] == pytest.approx(25.0, rel=0.10)
    # pooled ITL: one gap per chunk after the first
    assert len([g for gaps in result["itls"] for g in gaps]) == sum(result["output_lens"]) - 8
    assert result["tok_per_s_per_user"] == pytest.approx(1000 / result["median_tpot_ms"])


def test_server_errors_are_counted_as_failed(fake):
    fake.reset(ttft_s=0.005, itl_s=0.002, fail_every=3)
    requests = sample_random_requests(_WordTokenizer(), 9, 20, 4, 1.0, seed=1)
    result = asyncio.run(serve.benchmark(
        api_url=fake.base_url + "/v1/completions", model="fake-model", requests=requests,
        max_concurrency=1, disable_tqdm=True, show_summary=False))
    assert (result["completed"], result["failed"]) == (6, 3)
    assert result["completed"] + result["failed"] == result["num_prompts"] == 9
    failed = [e for e in result["errors"] if e]
    assert len(failed) == 3 and all(e.startswith("HTTP 500") for e in failed)
    assert result["total_output_tokens"] == 6 * 4
    assert result["output_lens"].count(0) == 3


def test_missing_usage_chunk_fails_the_request(fake):
    fake.reset(ttft_s=0.001, itl_s=0.001)
    requests = sample_random_requests(_WordTokenizer(), 2, 10, 3, 1.0, seed=2)
    result = asyncio.run(serve.benchmark(
        api_url=fake.base_url + "/v1/completions", model="fake-model", requests=requests,
        extra_body={"stream_options": {"include_usage": False}}, disable_tqdm=True,
        show_summary=False))
    assert result["failed"] == 2
    assert "completion_tokens" in result["errors"][0]


def _parse(module, argv):
    parser = argparse.ArgumentParser()
    module.add_cli_args(parser)
    return parser.parse_args(argv)


def test_cli_main_chat_endpoint_saves_vllm_keys(fake, tmp_path):
    fake.reset(ttft_s=0.2, itl_s=0.01)
    args = _parse(serve, [
        "--base-url", fake.base_url + "/v1", "--endpoint-type", "chat",
        "--tokenizer", _tokenizer_dir(tmp_path), "--random-input-len", "32",
        "--random-output-len", "6", "--random-range-ratio", "0", "--num-prompts", "4",
        "--max-concurrency", "2", "--num-warmups", "2", "--goodput", "ttft:1000",
        "--save-result", "--result-dir", str(tmp_path / "out"), "--result-filename", "r.json",
        "--disable-tqdm"])
    result = serve.main(args)
    assert fake.num_requests == 6  # 2 warm-ups + 4 measured
    assert result["model_id"] == "fake-model"  # from /v1/models
    assert result["backend"] == "openai-chat"
    assert (result["completed"], result["num_warmups"]) == (4, 2)
    # the role-only chunk (sent at once) does not end TTFT; the first text chunk (200 ms) does
    assert 200.0 <= min(result["ttfts"]) * 1000 < 400.0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    with open(tmp_path / "out" / "r.json") as f:
        saved = json.load(f)
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "p50_tpot_ms",
                "p90_itl_ms", "mean_e2el_ms", "duration", "max_concurrency", "request_rate",
                "num_prompts", "tok_per_s_per_gpu", "tok_per_s_per_user"):
        assert key in saved, key
    assert saved["request_rate"] == "inf" and saved["max_concurrency"] == 2
    assert "itls" not in saved  # per-request lists only with --save-detailed
    # saved by default, as vLLM does
    assert len(saved["latencies"]) == 4 and len(saved["start_times"]) == 4 and min(saved["start_times"]) == 0
    # input tokens as the server counted them (the fake counts characters), not the dataset's
    assert saved["total_input_tokens"] == sum(len(p) for p in fake.prompts[2:])


def test_vllm_bench_serve_flags_and_defaults(fake, tmp_path):
    fake.reset(ttft_s=0.01, itl_s=0.001, root=_tokenizer_dir(tmp_path))
    args = _parse(serve, ["--base-url", fake.base_url, "--backend", "openai-chat", "--random-input-len", "16",
                          "--random-output-len", "3", "--num-prompts", "3", "--disable-tqdm"])
    assert args.range_ratio_mode == "vllm"     # vllm bench serve's defaults
    result = serve.main(args)                 # no --tokenizer: the server's model root has one
    assert result["ignore_eos"] is False      # (unset: off for the random dataset)
    assert result["backend"] == "openai-chat" and result["completed"] == 3
    assert result["tokenizer_id"] == str(tmp_path) and result["random_range_ratio"] == 0.0
    sweep_args = _parse(sweep, ["--base-url", fake.base_url])
    assert (sweep_args.range_ratio_mode, sweep_args.ignore_eos) == ("inferencex", True)   # InferenceX's
    with pytest.raises(ValueError, match="--backend vllm sends completions"):
        serve.main(_parse(serve, ["--base-url", fake.base_url, "--backend", "vllm", "--endpoint-type", "chat"]))


def test_sweep_runs_inferencex_points_and_saves_json(fake, tmp_path):
    fake.reset(ttft_s=0.005, itl_s=0.002)
    args = _parse(sweep, [
        "--base-url", fake.base_url, "--tokenizer", _tokenizer_dir(tmp_path),
        "--random-input-len", "16", "--random-output-len", "4", "--concurrencies", "1,2",
        "--result-dir", str(tmp_path / "sweep"), "--label", "fake", "--no-plot",
        "--disable-tqdm"])
    combined = sweep.main(args)
    assert fake.num_requests == (10 + 2) * 1 + (10 + 2) * 2
    prompts = fake.prompts  # every point's prompts are new to the server (no prefix-cache reuse)
    assert len(set(prompts)) == len(prompts)
    points = combined["points"]
    assert [p["max_concurrency"] for p in points] == [1, 2]
    assert [p["num_prompts"] for p in points] == [10, 20]
    assert [p["num_warmups"] for p in points] == [2, 4]
    assert [p["completed"] for p in points] == [10, 20]
    assert all(p["request_rate"] == "inf" for p in points)
    out = tmp_path / "sweep"
    assert sorted(os.listdir(out)) == ["fake-c1.json", "fake-c2.json", "fake-sweep.json"]
    with open(out / "fake-c2.json") as f:
        assert json.load(f)["completed"] == 20


def test_sweep_chart_or_clear_matplotlib_error(tmp_path):
    fake_sweep = {"label": "a", "random_input_len": 8192, "random_output_len": 1024,
                  "points": [{"max_concurrency": c, "tok_per_s_per_gpu": 100.0 * c,
                              "tok_per_s_per_user": 100.0 / c} for c in (1, 2, 4)]}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install matplotlib"):
            sweep.plot_sweeps([fake_sweep], str(tmp_path / "c.png"))
        pytest.skip("matplotlib not installed: checked the error, chart not drawn")
    path = sweep.plot_sweeps([fake_sweep], str(tmp_path / "c.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_agentic_sweep_plays_sessions_per_concurrency(fake, tmp_path):
    fake.reset(ttft_s=0.002, itl_s=0.001)
    args = _parse(sweep, [
        "--base-url", fake.base_url, "--tokenizer", _tokenizer_dir(tmp_path),
        "--dataset-name", "agentic", "--agentic-turns", "2", "--agentic-first-input-len", "12",
        "--agentic-new-tokens", "4", "--agentic-output-len", "3", "--agentic-output-len-sigma", "0",
        "--agentic-think-time", "0", "--concurrencies", "1,2", "--warmups-per-concurrency", "0",
        "--result-dir", str(tmp_path / "sweep"), "--label", "ag", "--no-plot", "--disable-tqdm"])
    combined = sweep.main(args)
    points = combined["points"]
    assert [p["max_concurrency"] for p in points] == [1, 2]
    assert [p["num_sessions"] for p in points] == [2, 4]          # 2 sessions per concurrency
    assert [p["completed"] for p in points] == [4, 8] and fake.num_requests == 12
    assert all(p["total_output_tokens"] == 3 * p["completed"] for p in points)   # ignore_eos
    assert all(p["p90_e2e_norm_intvty"] > 0 and len(p["per_turn"]) == 2 for p in points)
    # the fake server has no /metrics: no prefix-cache figures, but no failure either
    assert points[0]["prefix_cache_hits_gpu"] is None and points[0]["reprefilled_tokens"] is None
    # each second turn re-sends a first turn; every point's sessions are new (a seed per point)
    prompts = fake.prompts
    first_turns = [p for p in prompts if not any(q != p and p.startswith(q) for q in prompts)]
    assert len(set(first_turns)) == len(first_turns) == 6
    assert all(sum(p.startswith(q) for q in first_turns) == 1 for p in prompts)
    assert sorted(os.listdir(tmp_path / "sweep")) == ["ag-c1.json", "ag-c2.json", "ag-sweep.json"]
