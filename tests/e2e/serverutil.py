"""Helpers of the server tests: a live `m3serve serve` subprocess on a free 127.0.0.1 port, and
an in-process app whose engine is a scripted stand-in emitting the tokens of a given text.
"""
import asyncio
import os
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from m3serve.engine.engine_group import free_port  # noqa: F401  (the servers' tests take ports here)
from m3serve.model.files import load_tokenizer
from m3serve.protocol import CoreOutput, EngineReady, EngineStats

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"


class LiveServer:
    """A `python -m m3serve serve` child process; `url` is its base URL."""

    def __init__(self, model_dir: Path, *flags: str, log_path: Path, env: dict | None = None,
                 wait: bool = True, preexec_fn=None, tls_ca: Path | None = None):
        self.port = free_port()
        # with TLS flags: trust the CA its certificate chains to
        self.verify = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else True
        self.url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{self.port}"
        self.log_path = log_path
        path = os.pathsep.join([str(REPO_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        cmd = [sys.executable, "-m", "m3serve", "serve", str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", MODEL_NAME,
               "--uvicorn-log-level", "warning", *flags]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=preexec_fn)
        if wait:
            self.wait_ready()

    @classmethod
    def start_many(cls, model_dir: Path, specs: dict[str, tuple], log_dir: Path, **kwargs) -> dict:
        """Launch several servers at once (name -> flags), then wait for all of them."""
        servers = {name: cls(model_dir, *flags, log_path=log_dir / f"{name}.log", wait=False, **kwargs)
                   for name, flags in specs.items()}
        try:
            for srv in servers.values():
                srv.wait_ready()
        except Exception:
            for srv in servers.values():
                srv.stop()
            raise
        return servers

    def wait_ready(self) -> None:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(self.url + "/ready", timeout=2, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become ready:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: metric name -> value (label sets summed)."""
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Metrics once no sequence runs or waits and no KV block is held (a moment with
        nothing running can still hold waiting requests whose aborts have not landed yet)."""
        deadline = time.time() + timeout_s
        while True:
            metrics = self.metrics()
            if (metrics["m3serve:num_requests_running"] == 0 and metrics["m3serve:num_requests_waiting"] == 0
                    and metrics["m3serve:kv_cache_usage_perc"] == 0):
                return metrics
            assert time.time() < deadline, metrics
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class ScriptedEngineClient:
    """Stands in for `EngineCoreClient`: every sequence emits the token ids of `script`
    (`tokens_per_output` per output, finish "stop", or "length" at max_tokens)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None):
        self.tokenizer = tokenizer
        self.info = EngineReady(max_model_len=4096, block_size=16, num_usable_blocks=1024,
                                vocab_size=vocab_size, eos_token_id=eos_token_id)
        self.stats = EngineStats()
        self.script = ""
        self.scripts: list[str] = []    # when not empty, each request emits the next of these instead
        self.tokens_per_output = 1
        self.requests = []  # EngineCoreRequests received
        self.aborted: list[str] = []

    async def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def is_healthy(self) -> bool:
        return True

    async def get_stats(self, timeout_s: float = 5.0) -> EngineStats:
        return self.stats

    async def add_requests(self, parent_id, requests):
        queue: asyncio.Queue = asyncio.Queue()
        script = self.scripts.pop(0) if self.scripts else self.script
        ids = self.tokenizer.encode(script, add_special_tokens=False).ids
        for request in requests:
            self.requests.append(request)
            asyncio.get_running_loop().create_task(self._emit(queue, request, ids))
        return queue

    async def _emit(self, queue, request, ids):
        limit = request.sampling_params.max_tokens or len(ids)
        ids = ids[:limit]
        step = self.tokens_per_output
        for start in range(0, len(ids), step):
            await asyncio.sleep(0)
            chunk = ids[start:start + step]
            last = start + step >= len(ids)
            reason = ("length" if len(ids) == limit else "stop") if last else None
            queue.put_nowait(CoreOutput(request.request_id, chunk, finish_reason=reason))

    def abort(self, request_ids) -> None:
        self.aborted.extend(request_ids)


class InProcessServer:
    """uvicorn in a thread serving `build_app` over a `ScriptedEngineClient`."""

    def __init__(self, model_dir: Path, **server_flags):
        from m3serve.serving.api_server import build_app
        from m3serve.serving.server_args import ServerConfig

        tokenizer = load_tokenizer(model_dir)
        self.client = ScriptedEngineClient(tokenizer, tokenizer.get_vocab_size(), eos_token_id=None)
        self.port = free_port()
        config = ServerConfig(port=self.port, **server_flags)
        self.url = f"{config.scheme}://127.0.0.1:{self.port}"
        app = build_app(self.client, tokenizer, model_dir, config, MODEL_NAME)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                     log_level="warning", **config.uvicorn_ssl_kwargs()))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 30
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError("in-process server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
