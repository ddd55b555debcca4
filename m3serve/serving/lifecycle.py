"""The server process's life outside requests: graceful drain on SIGTERM/SIGINT and the
file-descriptor limit.

Drain (first SIGTERM or SIGINT): `/ready` answers 503 at once, so routers and load balancers
stop sending; every new request gets 503 with `Retry-After`; requests already running finish.
Those still running after `--shutdown-timeout` seconds are aborted (their clients get a 503
error saying why, their KV blocks are freed). Then the HTTP server stops, the engine processes
are shut down, and the process exits 0. A second signal during the drain exits at once (1).
"""
from __future__ import annotations

import asyncio
import logging
import resource
import signal
import time

import uvicorn

from m3serve.serving.errors import shape_for

logger = logging.getLogger(__name__)

# Kubernetes sends SIGKILL 30 s after SIGTERM by default (terminationGracePeriodSeconds): a
# 25 s drain leaves the engine time to stop and the process to exit 0 before that.
DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0
# Routes that keep answering while draining: probes and introspection, never new work.
_OPEN_WHILE_DRAINING = ("/health", "/ready", "/metrics", "/version", "/get_load", "/v1/loads", "/v1/models")


class Drain:
    """Drain state shared by the middleware, `/ready` and the server."""

    def __init__(self, timeout_s: float, retry_after_s: int, client):
        self.timeout_s, self.retry_after_s, self.client = timeout_s, retry_after_s, client
        self.draining = False
        self.in_flight = 0          # HTTP requests doing work (probes not counted)
        self.forced = False

    def middleware(self, app):
        """Pure ASGI middleware: counts requests in flight (streams until their last byte) and
        refuses new ones while draining."""

        async def wrapped(scope, receive, send):
            if scope["type"] != "http" or scope["path"].startswith(_OPEN_WHILE_DRAINING):
                return await app(scope, receive, send)
            if self.draining:
                message = "the server is shutting down; send this request elsewhere"
                return await shape_for(scope["path"]).response(503, message, headers={
                    "Retry-After": str(self.retry_after_s), "Connection": "close"})(scope, receive, send)
            self.in_flight += 1
            try:
                await app(scope, receive, send)
            finally:
                self.in_flight -= 1
        return wrapped

    async def run(self, server: uvicorn.Server) -> None:
        """Wait for the running requests (up to the timeout), abort the rest, then stop `server`."""
        start = time.monotonic()
        logger.info("draining: %d request(s) in flight; /ready is 503 and new requests get 503; "
                    "requests still running after %g s are aborted", self.in_flight, self.timeout_s)
        while self.in_flight and time.monotonic() - start < self.timeout_s and not self.forced:
            await asyncio.sleep(0.05)
        aborted = 0
        if self.in_flight and not self.forced:
            aborted = self.client.abort_all(f"the server is shutting down: the request was still running "
                                            f"after the {self.timeout_s:g} s drain timeout")
            settle = time.monotonic() + 5.0
            while self.in_flight and time.monotonic() < settle:
                await asyncio.sleep(0.02)
        in_use = await self._blocks_in_use()
        logger.info("drain over after %.1f s: %d sequence(s) aborted, KV blocks in use: %s",
                    time.monotonic() - start, aborted, in_use)
        server.should_exit = True

    async def _blocks_in_use(self) -> str:
        try:
            stats = await self.client.get_stats(timeout_s=2.0)
        except Exception as e:
            return f"unknown ({e})"
        return str(stats.num_usable_blocks - stats.num_free_blocks)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain above in place of its immediate stop on the first signal."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # (never re-raised after shutdown, unlike uvicorn's own handler: a drained exit is 0)
        if self.drain.draining or self.should_exit or self._loop is None:
            if self.drain.draining:
                logger.warning("second %s: exiting now", signal.Signals(sig).name)
            self.drain.forced = True
            self.should_exit = self.force_exit = True
            return
        self.drain.draining = True
        logger.info("%s received", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.drain.run(self)))


def raise_fd_limit(max_num_seqs: int, max_waiting: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit and log it; warn when it is below what a
    full engine may need (a connection per running and per waiting request, and a reserve for
    the model files, sockets and processes). Returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, 1 << 20) if hard == resource.RLIM_INFINITY else hard
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    need = max_num_seqs + max_waiting + 256
    logger.info("open-file limit: %d (hard %s)", soft, "unlimited" if hard == resource.RLIM_INFINITY else hard)
    if soft < need:
        logger.warning("the open-file limit %d is below the %d that %d running + %d waiting requests "
                       "(one connection each) and 256 for the engine may need: connections past it are "
                       "refused; raise it (ulimit -n, or LimitNOFILE in systemd)", soft, need,
                       max_num_seqs, max_waiting)
    return soft, hard


def describe_engine(config, info) -> str:
    """The effective engine configuration in one block (logged at start-up): what was asked
    for, and the memory plan the engine made (`info`: its `EngineReady`, or None)."""
    m, c, s, p = config.model, config.cache, config.scheduler, config.parallel
    max_len = info.max_model_len if info is not None else (m.max_model_len or 0)
    lines = [
        f"model {m.model or 'the tiny model'}, dtype {m.dtype}, weights {m.quantization or 'as stored'}, "
        f"load format {m.load_format}, device {m.device}",
        f"parallel: TP {p.tensor_parallel_size} x DP {p.data_parallel_size}"
        f"{', expert parallel' if p.enable_expert_parallel else ''}",
        f"KV cache dtype {c.kv_cache_dtype}, index cache dtype {c.index_cache_dtype}, prefix caching "
        f"{'on' if c.enable_prefix_caching else 'off'}"
        f"{f', CPU tier {c.kv_offloading_size:g} GiB ({c.kv_offloading_backend})' if c.kv_offloading_size else ''}",
        f"scheduler: {s.max_num_batched_tokens} tokens per step, {s.max_num_seqs} running, "
        f"{s.max_waiting_requests} waiting at most, async scheduling "
        f"{'off (' + blocker + ')' if (blocker := config.async_scheduling_off()) else 'on'}"
        f"{f', {cap} tokens per request per step' if (cap := s.effective_long_prefill_threshold(max_len)) else ''}"
        f"{f', {s.max_num_partial_prefills} prefills per step' if s.max_num_partial_prefills else ''}",
        f"CUDA graphs {'off (--enforce-eager)' if config.compilation.enforce_eager else 'on where a GPU runs'}"
        f"{', speculative ' + config.speculative.method if config.speculative.enabled else ''}"
        f"{', KV transfer ' + config.kv_transfer.kv_role if config.kv_transfer.enabled else ''}",
    ]
    if info is not None:
        lines.append(f"memory plan: {info.num_usable_blocks} KV blocks of {info.block_size} tokens "
                     f"({info.num_usable_blocks * info.block_size} tokens) per replica, max_model_len "
                     f"{info.max_model_len}")
        if not info.media_refusal:
            lines.append(f"images and video: up to {m.mm_encoder_cache_gb:g} GiB of vision-encoder outputs per "
                         f"rank (--mm-encoder-cache-gb)"
                         f"{'' if c.kv_cache_memory else ', set aside before the KV cache on a GPU'}")
    return "engine configuration:\n  " + "\n  ".join(lines)
