"""`m3serve bench serve`: an asyncio load generator for any OpenAI-compatible server.

Owns the streaming request function (SSE over plain asyncio streams, with
`stream_options.include_usage`), the arrival schedule (unlimited or Poisson/gamma with
burstiness), the concurrency cap, warm-ups, the summary table and the result JSON (keys as
`vllm bench serve --save-result`).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import ssl
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlsplit

import numpy as np

from m3serve.bench.agentic import SyntheticConfig
from m3serve.bench.datasets import (RANGE_RATIO_MODES, SampleRequest, TokenizerView,
                                    load_tokenizer, sample_random_requests)
from m3serve.bench.metrics import (DEFAULT_PERCENTILES, METRIC_NAMES, RequestRecord,
                                   compute_metrics, parse_goodput, parse_percentile_metrics,
                                   parse_percentiles, percentile_key)

ENDPOINT_TYPES = ("completions", "chat")
DATASET_NAMES = ("random", "random-mm", "agentic", "agentic-trace")
AGENTIC_DATASETS = ("agentic", "agentic-trace")
_DEFAULT_ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# vLLM's names for the two request formats, kept in the result JSON for comparability.
_BACKEND_NAMES = {"completions": "openai", "chat": "openai-chat"}
_BACKENDS = {"vllm": "completions", "openai": "completions", "openai-chat": "chat"}   # --backend
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")
_REQUEST_TIMEOUT_S = 6 * 3600


GREEDY = {"temperature": 0.0}


def _build_payload(endpoint_type: str, model: str, request: SampleRequest, ignore_eos: bool,
                   extra_body: dict | None, sampling: dict | None = None) -> dict:
    payload: dict = {
        "model": model,
        **(GREEDY if sampling is None else sampling),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.images and endpoint_type != "chat":
        raise ValueError("images (--dataset-name random-mm) need the chat endpoint (--backend openai-chat)")
    if endpoint_type == "chat":
        if request.messages is not None:
            payload["messages"] = request.messages
        else:
            content = request.prompt
            if request.images:
                content = [{"type": "text", "text": request.prompt}] + [
                    {"type": "image_url", "image_url": {"url": url}} for url in request.images]
            payload["messages"] = [{"role": "user", "content": content}]
        payload["max_completion_tokens"] = request.expected_output_len
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.expected_output_len
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra_body or {})
    return payload


def _chunk_text(chunk: dict, endpoint_type: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint_type == "chat":
        delta = choices[0].get("delta") or {}
        # Thinking models stream reasoning separately; it is generated text all the same.
        return (delta.get("content") or delta.get("reasoning_content")
                or delta.get("reasoning") or "")
    return choices[0].get("text") or ""


@functools.lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    return ssl.create_default_context()


class HTTPStatusError(Exception):
    """A non-200 answer; the message holds the status and the start of the body."""


async def _post_stream(url: str, body: bytes, headers: dict[str, str]):
    """POST `body` over a fresh HTTP/1.1 connection and yield the response body in pieces as
    they arrive. Raises HTTPStatusError on a non-200 status.

    A hand-rolled client on asyncio streams: per SSE chunk it costs a fraction of what httpx
    costs, which keeps the load generator from becoming the bottleneck at high concurrency.
    One connection per request (as vLLM's client forces) keeps requests independent.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"api_url must be an http(s) URL, got {url!r}")
    is_https = parts.scheme == "https"
    port = parts.port or (443 if is_https else 80)
    reader, writer = await asyncio.open_connection(
        parts.hostname, port, ssl=_ssl_context() if is_https else None,
        limit=1 << 22)
    try:
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        lines = [f"POST {target or '/'} HTTP/1.1", f"Host: {parts.netloc}",
                 "Content-Type: application/json", "Accept: text/event-stream",
                 f"Content-Length: {len(body)}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        status_line = await reader.readline()
        fields = status_line.split(None, 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/"):
            raise ConnectionError(f"bad HTTP status line {status_line[:100]!r}")
        status = int(fields[1])
        response_headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            response_headers[name.strip().lower()] = value.strip()
        if status != 200:
            text = b"".join([piece async for piece in _read_body(reader, response_headers)])
            raise HTTPStatusError(f"HTTP {status}: {text.decode('utf-8', 'replace')[:500]}")
        async for piece in _read_body(reader, response_headers):
            yield piece
    finally:
        writer.close()


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]):
    """Yield the body per chunked-encoding chunk, per Content-Length read, or until EOF."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the CRLF after each chunk
    elif "content-length" in headers:
        remaining = int(headers["content-length"])
        while remaining > 0:
            piece = await reader.read(min(remaining, 1 << 16))
            if not piece:
                raise ConnectionError("connection closed before the end of the body")
            remaining -= len(piece)
            yield piece
    else:
        while piece := await reader.read(1 << 16):
            yield piece


async def _sse_data(pieces):
    """(arrival time, payload) for every `data:` line of an SSE byte stream."""
    buffer = b""
    async for piece in pieces:
        now = time.perf_counter()
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield now, line[5:].strip()
    if buffer.startswith(b"data:"):
        yield time.perf_counter(), buffer[5:].strip()


@dataclass(frozen=True)
class Target:
    """Where and how to send requests: the full endpoint URL and the request-body options."""

    api_url: str
    model: str
    endpoint_type: str = "completions"
    ignore_eos: bool = True
    extra_body: dict | None = None
    headers: dict = field(default_factory=dict)
    sampling: dict | None = None      # sampling fields of every request; None = greedy


async def send_request(target: Target, request: SampleRequest) -> RequestRecord:
    """Send one streaming request and time every chunk that carries generated text.

    Never raises: transport errors, HTTP errors, error chunks and a missing usage chunk all
    come back as a failed record with the reason in `error`.
    """
    payload = _build_payload(target.endpoint_type, target.model, request, target.ignore_eos,
                             target.extra_body, target.sampling)
    body = json.dumps(payload).encode()
    record = RequestRecord(prompt_len=request.prompt_len, start_time=time.perf_counter())
    texts: list[str] = []
    completion_tokens = prompt_tokens = None
    try:
        pieces = _post_stream(target.api_url, body, target.headers)
        events = _sse_data(pieces)
        # aclosing: leaving the loop early ([DONE], an error chunk) closes the connection now.
        async with asyncio.timeout(_REQUEST_TIMEOUT_S), aclosing(pieces), aclosing(events):
            async for now, data in events:
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk or chunk.get("object") == "error":
                    record.error = f"error chunk: {data[:500].decode('utf-8', 'replace')}"
                    return record
                text = _chunk_text(chunk, target.endpoint_type)
                usage = chunk.get("usage")
                if text:
                    record.chunk_times.append(now)
                    texts.append(text)
                    if usage and usage.get("completion_tokens") is not None:    # continuous usage
                        so_far = int(usage["completion_tokens"])
                        record.chunk_tokens.append(so_far - sum(record.chunk_tokens))
                if usage and usage.get("completion_tokens") is not None:
                    completion_tokens = int(usage["completion_tokens"])
                if usage and usage.get("prompt_tokens") is not None:
                    prompt_tokens = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        record.cached_tokens = int(details["cached_tokens"])
    except Exception as exc:  # noqa: BLE001 -- one bad request must not stop the benchmark
        record.error = str(exc) if isinstance(exc, HTTPStatusError) else (
            f"{type(exc).__name__}: {exc}")
        return record
    record.generated_text = "".join(texts)
    if completion_tokens is None:
        record.error = ("no usage.completion_tokens in the stream "
                        "(server must honour stream_options.include_usage)")
    elif not record.chunk_times:
        record.error = "stream carried no generated text"
    else:
        record.output_tokens = completion_tokens
        if prompt_tokens is not None:
            record.prompt_len = prompt_tokens     # what the server computed (chat template too)
        record.success = True
    return record


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float,
                    seed: int) -> np.ndarray:
    """Send time of each request, seconds after the start: all 0 for an unlimited rate, else
    cumulative gamma intervals with mean 1/rate (burstiness 1 = Poisson arrivals)."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(num_requests)  # [num_requests]
    rng = np.random.default_rng([seed, 2])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                     size=num_requests)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps)  # [num_requests]


async def _run_requests(target: Target, requests, offsets, max_concurrency,
                        pbar) -> list[RequestRecord]:
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(request: SampleRequest, offset: float) -> RequestRecord:
        delay = offset - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        if semaphore is None:
            record = await send_request(target, request)
        else:
            async with semaphore:
                record = await send_request(target, request)
        if pbar is not None:
            pbar.update(1)
        return record

    return await asyncio.gather(*(one(r, float(o)) for r, o in zip(requests, offsets)))


async def benchmark(*, api_url: str, model: str, requests: list[SampleRequest],
                    endpoint_type: str = "completions",
                    warmup_requests: list[SampleRequest] | None = None,
                    max_concurrency: int | None = None, request_rate: float = math.inf,
                    burstiness: float = 1.0, ignore_eos: bool = True,
                    percentiles=DEFAULT_PERCENTILES, percentile_metrics=METRIC_NAMES,
                    goodput: dict[str, float] | None = None, num_gpus: int = 1, seed: int = 0,
                    extra_body: dict | None = None, headers: dict | None = None,
                    disable_tqdm: bool = False, show_summary: bool = True,
                    sampling: dict | None = None) -> dict:
    """Run `requests` against `api_url` and return the metrics result dict.

    Warm-up requests run first at the same concurrency, all at once, and are not counted; if
    every one of them fails the server is taken to be unusable and RuntimeError is raised.
    """
    from tqdm import tqdm

    if endpoint_type not in ENDPOINT_TYPES:
        raise ValueError(f"endpoint_type must be one of {ENDPOINT_TYPES}, got {endpoint_type!r}")
    if not requests:
        raise ValueError("requests must not be empty")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    target = Target(api_url, model, endpoint_type, ignore_eos, extra_body, headers or {}, sampling)
    if warmup_requests:
        warm = await _run_requests(target, warmup_requests, np.zeros(len(warmup_requests)),
                                   max_concurrency, None)
        if not any(r.success for r in warm):
            raise RuntimeError(f"all {len(warm)} warm-up requests failed; first error: "
                               f"{warm[0].error}")
    pbar = None if disable_tqdm else tqdm(total=len(requests), desc="requests")
    spec_before = await spec_decode_counters(api_url, headers or {})
    start = time.perf_counter()
    records = await _run_requests(target, requests, offsets, max_concurrency, pbar)
    duration = time.perf_counter() - start
    spec_after = await spec_decode_counters(api_url, headers or {})
    if pbar is not None:
        pbar.close()
    result = compute_metrics(records, duration, percentiles=percentiles,
                             percentile_metrics=percentile_metrics, goodput=goodput,
                             num_gpus=num_gpus)
    result.update({
        "num_prompts": len(requests),
        "num_warmups": len(warmup_requests or []),
        "max_concurrency": max_concurrency,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "burstiness": burstiness,
    })
    if spec_before is not None and spec_after is not None:
        result.update(spec_decode_summary(spec_before, spec_after))
    if show_summary:
        print_summary(result, percentiles, percentile_metrics)
    return result


METRIC_PREFIXES = ("m3serve:", "vllm:")


def metric_lines(text: str) -> list[tuple[str, str, float]]:
    """(name without prefix, labels, value) of every sample of a Prometheus text exposition
    in one naming family: `m3serve:` when the server has any such sample, else `vllm:`.
    (m3serve exposes each metric under both prefixes; counting both would double it.)"""
    samples = []
    for line in text.splitlines():
        if line.startswith(METRIC_PREFIXES):
            name_labels, _, value = line.rpartition(" ")
            prefix, _, rest = name_labels.partition(":")
            name, _, labels = rest.partition("{")
            samples.append((prefix, name, labels, value))
    family = "m3serve" if any(p == "m3serve" for p, *_ in samples) else "vllm"
    out = []
    for prefix, name, labels, value in samples:
        if prefix == family:
            try:
                out.append((name, labels, float(value)))
            except ValueError:
                continue
    return out


async def metrics_text(api_url: str, headers: dict) -> str | None:
    """The text of the server's Prometheus /metrics (same host as `api_url`); None when it
    cannot be read."""
    import httpx

    parts = urlsplit(api_url)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(f"{parts.scheme}://{parts.netloc}/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def parse_spec_decode_counters(text: str) -> dict | None:
    """Spec-decode counters of a /metrics text (our names or vLLM's), summed over label sets;
    per-position counts under "per_pos". None when there are none (speculation off)."""
    out: dict = {"per_pos": {}}
    for name, labels, value in metric_lines(text):
        if not name.startswith("spec_decode_") or name.endswith("_created"):
            continue
        name = name.removeprefix("spec_decode_").removesuffix("_total")
        if name == "num_accepted_tokens_per_pos":
            pos = int(labels.split('position="', 1)[1].split('"', 1)[0])
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + value
        else:
            out[name] = out.get(name, 0.0) + value
    return out if "num_drafts" in out else None


async def spec_decode_counters(api_url: str, headers: dict) -> dict | None:
    """The server's spec-decode counters now (see parse_spec_decode_counters); None when it
    reports none or has no /metrics."""
    text = await metrics_text(api_url, headers)
    return None if text is None else parse_spec_decode_counters(text)


def spec_decode_summary(before: dict, after: dict) -> dict:
    """The run's spec-decode figures from two counter snapshots (vLLM bench serve's names)."""
    def diff(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts, tokens, accepted = diff("num_drafts"), diff("num_draft_tokens"), diff("num_accepted_tokens")
    positions = sorted(after["per_pos"])
    return {"spec_decode_num_drafts": int(drafts), "spec_decode_num_draft_tokens": int(tokens),
            "spec_decode_num_accepted_tokens": int(accepted),
            "spec_decode_acceptance_rate": accepted / tokens if tokens else 0.0,
            "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "spec_decode_acceptance_per_position": [
                (after["per_pos"][p] - before["per_pos"].get(p, 0.0)) / drafts if drafts else 0.0
                for p in positions]}


def print_summary(result: dict, percentiles=DEFAULT_PERCENTILES,
                  percentile_metrics=METRIC_NAMES) -> None:
    """Print the result as vLLM's summary table, plus the InferenceX per-GPU/per-user figures."""
    def row(label: str, value, fmt: str = ".2f") -> None:
        text = "n/a" if value is None else (format(value, fmt) if fmt else str(value))
        print(f"{label:<40} {text:<10}")

    print("{:=^60}".format(" Serving Benchmark Result "))
    row("Successful requests:", result["completed"], "")
    row("Failed requests:", result["failed"], "")
    first_error = next((e for e in result.get("errors", []) if e), None)
    if first_error:
        print(f"First error: {first_error[:300]}")
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"], "")
    if result.get("request_rate") not in (None, "inf"):
        row("Request rate configured (RPS):", result["request_rate"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "")
    row("Total generated tokens:", result["total_output_tokens"], "")
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    row(f"Total tok/s/GPU ({result['num_gpus']} GPU):", result["tok_per_s_per_gpu"])
    row("Interactivity (tok/s/user):", result["tok_per_s_per_user"])
    titles = {"ttft": ("TTFT", "Time to First Token"),
              "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
              "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
    for name in percentile_metrics:
        short, title = titles[name]
        print("{:-^60}".format(title))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", result[f"median_{name}_ms"])
        row(f"Std {short} (ms):", result[f"std_{name}_ms"])
        for p in percentiles:
            key = percentile_key(p)
            row(f"{key.upper()} {short} (ms):", result[f"{key}_{name}_ms"])
    if result.get("spec_decode_num_drafts"):
        print("{:-^60}".format("Speculative Decoding"))
        row("Acceptance rate (%):", result["spec_decode_acceptance_rate"] * 100)
        row("Acceptance length:", result["spec_decode_acceptance_length"])
        row("Drafts:", result["spec_decode_num_drafts"], "")
        row("Draft tokens:", result["spec_decode_num_draft_tokens"], "")
        row("Accepted tokens:", result["spec_decode_num_accepted_tokens"], "")
        for pos, rate in enumerate(result["spec_decode_acceptance_per_position"]):
            row(f"Acceptance at position {pos}:", rate, ".3f")
    print("=" * 60)


def add_common_args(parser: argparse.ArgumentParser, inferencex: bool = False) -> None:
    """Flags shared by `bench serve` and `bench sweep`: target, dataset, reporting. Defaults are
    `vllm bench serve`'s (range ratio 0 around L, no ignore_eos), or InferenceX's for the sweep
    (`inferencex`: lengths in [0.8 L, L], ignore_eos)."""
    parser.add_argument("--base-url", default=None,
                        help="server URL, e.g. http://10.0.0.1:8000 (overrides --host/--port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default=None,
                        help="API path; default /v1/completions or /v1/chat/completions "
                             "by --endpoint-type")
    parser.add_argument("--endpoint-type", choices=ENDPOINT_TYPES, default=None,
                        help="request format; default inferred from --endpoint "
                             "(completions when neither is given)")
    parser.add_argument("--backend", choices=tuple(_BACKENDS), default=None,
                        help="vLLM's name for the request format: vllm or openai (completions), "
                             "openai-chat (chat)")
    parser.add_argument("--api-key", default=None,
                        help="sent as 'Authorization: Bearer KEY' when the server needs one")
    parser.add_argument("--model", default=None,
                        help="model name sent in requests; default: first id of /v1/models")
    parser.add_argument("--tokenizer", default=None,
                        help="directory with tokenizer.json (or the file, or a hub id) used to build "
                             "prompts; default: --model, else the model directory the server reports")
    parser.add_argument("--dataset-name", choices=DATASET_NAMES, default="random",
                        help="random: independent random prompts; random-mm: the random prompts "
                             "with random images (chat endpoint); agentic: synthetic multi-turn "
                             "sessions (--agentic-*); agentic-trace: sessions replayed from the "
                             "JSONL trace at --dataset-path")
    parser.add_argument("--dataset-path", default=None,
                        help="JSONL trace for --dataset-name agentic-trace (m3serve sessions or "
                             "InferenceX AgentX / Weka traces; docs/benchmarks.md)")
    parser.add_argument("--random-mm-base-items-per-request", type=int, default=1,
                        help="random-mm: images per request")
    parser.add_argument("--random-mm-image-sizes", default="672x672",
                        help="random-mm: comma-separated WIDTHxHEIGHT sizes, one drawn per image")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=None,
                        help="length spread; default 0.8 for --range-ratio-mode inferencex, "
                             "0.0 for vllm")
    parser.add_argument("--range-ratio-mode", choices=RANGE_RATIO_MODES,
                        default="inferencex" if inferencex else "vllm",
                        help="vllm: lengths uniform in [L*(1-r), L*(1+r)]; "
                             "inferencex: uniform in [floor(r*L), L]")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction,
                        default=True if inferencex else None,
                        help="ask the server to generate exactly max_tokens (default: "
                             f"{'on, as InferenceX' if inferencex else 'off, as vllm bench serve; on for the agentic datasets, as AgentX'})")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature of every request (default: 0, greedy)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--server-sampling-defaults", action="store_true",
                        help="send no sampling field the flags above do not set, so the server's "
                             "defaults (its model's generation config) apply")
    parser.add_argument("--extra-body", type=json.loads, default=None,
                        help="JSON object merged into every request body")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-gpus", type=int, default=1,
                        help="GPUs behind the server, for tok/s/GPU")
    parser.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES),
                        help="comma-separated subset of ttft,tpot,itl,e2el to report")
    parser.add_argument("--metric-percentiles", default="50,90,99",
                        help="comma-separated percentiles, e.g. 50,90,99")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                        help="SLOs for goodput, e.g. ttft:2000 tpot:50 e2el:60000")
    parser.add_argument("--label", default=None, help="prefix of result file names")
    parser.add_argument("--save-result", action="store_true", help="write the result JSON")
    parser.add_argument("--save-detailed", action="store_true",
                        help="also write per-request lists (input_lens, ttfts, itls, errors, ...)")
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--disable-tqdm", action="store_true")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """All flags of `m3serve bench serve`."""
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of arrival gaps; 1 = Poisson")
    parser.add_argument("--num-warmups", type=int, default=0,
                        help="warm-up requests, sent first and not counted")
    add_agentic_args(parser)


def add_agentic_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the agentic datasets (defaults and their sources: docs/benchmarks.md §8)."""
    d = SyntheticConfig()
    g = parser.add_argument_group("agentic multi-turn sessions (--dataset-name agentic | agentic-trace); "
                                  "--max-concurrency caps live sessions, --request-rate is "
                                  "the session arrival rate")
    g.add_argument("--agentic-sessions", type=int, default=None,
                   help=f"sessions to play (synthetic default {d.num_sessions}; trace: the first N, "
                        "default all)")
    g.add_argument("--agentic-turns", type=int, default=None,
                   help=f"turns per session (synthetic default {d.num_turns}; trace: at most N)")
    g.add_argument("--agentic-min-turns", type=int, default=None,
                   help="synthetic: turns per session uniform in [this, --agentic-turns]")
    g.add_argument("--agentic-first-input-len", type=int, default=d.first_input_len,
                   help="tokens of a session's first turn (system + tools + first request)")
    g.add_argument("--agentic-new-tokens", type=float, default=d.new_tokens_median,
                   help="median user/tool tokens appended per later turn (lognormal)")
    g.add_argument("--agentic-new-tokens-sigma", type=float, default=d.new_tokens_sigma)
    g.add_argument("--agentic-output-len", type=float, default=d.output_len_median,
                   help="median output tokens per turn (lognormal; max_tokens)")
    g.add_argument("--agentic-output-len-sigma", type=float, default=d.output_len_sigma)
    g.add_argument("--agentic-think-time", type=float, default=d.think_time_median_s,
                   help="median seconds between a reply's end and the next turn (lognormal)")
    g.add_argument("--agentic-think-time-sigma", type=float, default=d.think_time_sigma)
    g.add_argument("--agentic-max-think-time", type=float, default=d.max_think_time_s,
                   help="cap on think times, synthetic and replayed (AgentX: 10 s)")


def resolve_urls(args: argparse.Namespace) -> tuple[str, str, str]:
    """(base_url, api_url, endpoint_type) from --base-url/--host/--port/--endpoint(-type)."""
    endpoint_type = args.endpoint_type
    backend = getattr(args, "backend", None)
    if backend is not None:
        if endpoint_type is not None and endpoint_type != _BACKENDS[backend]:
            raise ValueError(f"--backend {backend} sends {_BACKENDS[backend]} requests, "
                             f"but --endpoint-type says {endpoint_type}")
        endpoint_type = _BACKENDS[backend]
    if endpoint_type is None:
        is_chat = bool(args.endpoint) and args.endpoint.rstrip("/").endswith("chat/completions")
        endpoint_type = "chat" if is_chat else "completions"
    endpoint = args.endpoint or _DEFAULT_ENDPOINTS[endpoint_type]
    if not endpoint.startswith("/"):
        raise ValueError(f"endpoint must start with '/', got {endpoint!r}")
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    # Accept an OpenAI-style base URL ending in /v1 as well as a bare server URL.
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[:-len("/v1")]
    return base, base + endpoint, endpoint_type


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    """HTTP headers every request carries (the bearer token of --api-key)."""
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def first_model(base_url: str, headers: dict[str, str] | None = None) -> dict:
    """The first model listed by GET {base_url}/v1/models (`id`, and `root`: its directory or
    hub id on servers that say, as vLLM and m3serve do)."""
    import httpx

    async with httpx.AsyncClient(timeout=60.0, headers=headers) as client:
        response = await client.get(f"{base_url}/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]


def resolve_tokenizer(args: argparse.Namespace, served: dict | None = None) -> tuple[str, TokenizerView]:
    """(tokenizer path, view) from --tokenizer, else --model, else the server's model `root`
    (each a directory, a tokenizer.json file, or a hub id)."""
    for path in (args.tokenizer, args.model, (served or {}).get("root")):
        if not path:
            continue
        if os.path.exists(path):
            return path, TokenizerView(load_tokenizer(path))
        if "/" in path and not path.startswith(("/", ".")):     # an org/name hub id
            local = _hub_tokenizer(path)
            if local is not None:
                return path, TokenizerView(load_tokenizer(local))
            if path == args.tokenizer:
                raise ValueError(f"--tokenizer {path!r}: no such directory or file, and no hub repo "
                                 f"with a tokenizer.json")
    raise ValueError("no tokenizer: pass --tokenizer (a directory with tokenizer.json, or a hub id); "
                     "neither --model nor the server's model root names one")


def _hub_tokenizer(repo: str) -> str | None:
    """A hub repo's tokenizer.json, downloaded (None when there is none to be had)."""
    try:
        from huggingface_hub import hf_hub_download
        return hf_hub_download(repo, "tokenizer.json")
    except Exception:   # noqa: BLE001 -- not a repo, offline, no such file: the caller says so
        return None


def range_ratio(args: argparse.Namespace) -> float:
    """--random-range-ratio, or the mode's default (0.8 InferenceX, 0.0 vLLM)."""
    if args.random_range_ratio is not None:
        return args.random_range_ratio
    return 0.8 if args.range_ratio_mode == "inferencex" else 0.0


def make_requests(args: argparse.Namespace, view: TokenizerView, num_prompts: int,
                  num_warmups: int) -> tuple[list[SampleRequest], list[SampleRequest]]:
    """Measured requests and warm-up requests; warm-ups use their own seed so that they do not
    pre-fill the server's prefix cache with the measured prompts."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if num_warmups < 0:
        raise ValueError(f"num_warmups must be >= 0, got {num_warmups}")
    common = dict(input_len=args.random_input_len, output_len=args.random_output_len,
                  range_ratio=range_ratio(args), range_ratio_mode=args.range_ratio_mode)
    requests = sample_random_requests(view, num_prompts, seed=args.seed, **common)
    warmups = (sample_random_requests(view, num_warmups, seed=args.seed + 1_000_003, **common)
               if num_warmups else [])
    if getattr(args, "dataset_name", "random") == "random-mm":
        from m3serve.bench.datasets import add_random_images, parse_image_sizes
        if args.random_mm_base_items_per_request < 1:
            raise ValueError("--random-mm-base-items-per-request must be >= 1")
        sizes = parse_image_sizes(args.random_mm_image_sizes)
        n = args.random_mm_base_items_per_request
        requests = add_random_images(requests, n, sizes, args.seed)
        warmups = add_random_images(warmups, n, sizes, args.seed + 1_000_003)
    return requests, warmups


def check_dataset_args(args: argparse.Namespace) -> None:
    """Reject dataset flags that do not fit together, before anything is sent; resolve the
    --ignore-eos default (on for the agentic datasets, as AgentX locks it; else off)."""
    name = getattr(args, "dataset_name", "random")
    path = getattr(args, "dataset_path", None)
    if name == "agentic-trace" and not path:
        raise ValueError("--dataset-name agentic-trace needs --dataset-path FILE.jsonl")
    if path and name != "agentic-trace":
        raise ValueError(f"--dataset-path is read only by --dataset-name agentic-trace, not {name!r}")
    if getattr(args, "ignore_eos", None) is None:
        args.ignore_eos = name in AGENTIC_DATASETS


def config_record(args: argparse.Namespace, model: str, tokenizer_path: str,
                  endpoint_type: str) -> dict:
    """The run's configuration, written ahead of the metrics in the result JSON."""
    backend = _BACKEND_NAMES[endpoint_type]
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": tokenizer_path,
        "dataset_name": args.dataset_name,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": range_ratio(args),
        "range_ratio_mode": args.range_ratio_mode,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "sampling": sampling_of(args),
        **({"dataset_path": args.dataset_path} if getattr(args, "dataset_path", None) else {}),
    }


def sampling_of(args: argparse.Namespace) -> dict:
    """The sampling fields every request carries: greedy unless flags say otherwise; with
    --server-sampling-defaults only what the flags set."""
    given = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
             if getattr(args, k, None) is not None}
    return given if getattr(args, "server_sampling_defaults", False) else {**GREEDY, **given}


def save_result(result: dict, path: str, detailed: bool) -> str:
    """Write `result` as JSON at `path` (per-request lists only when `detailed`)."""
    data = result if detailed else {k: v for k, v in result.items() if k not in DETAILED_KEYS}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    return path


@dataclass
class Setup:
    """What every benchmark command resolves from its arguments before sending anything."""
    api_url: str
    endpoint_type: str
    percentiles: list
    percentile_metrics: list
    goodput: dict | None
    tokenizer_path: str
    view: object
    model: str


async def resolve_setup(args: argparse.Namespace) -> Setup:
    base_url, api_url, endpoint_type = resolve_urls(args)
    served = None
    if args.model is None or (args.tokenizer is None and not os.path.exists(args.model)):
        served = await first_model(base_url, auth_headers(args))
    tokenizer_path, view = resolve_tokenizer(args, served)
    model = args.model or served["id"]
    return Setup(api_url, endpoint_type, parse_percentiles(args.metric_percentiles),
                 parse_percentile_metrics(args.percentile_metrics), parse_goodput(args.goodput),
                 tokenizer_path, view, model)


async def main_async(args: argparse.Namespace) -> dict:
    """`m3serve bench serve` without the event loop: returns the full result dict."""
    check_dataset_args(args)
    setup = await resolve_setup(args)
    api_url, endpoint_type, model, view = setup.api_url, setup.endpoint_type, setup.model, setup.view
    percentiles, percentile_metrics, goodput = setup.percentiles, setup.percentile_metrics, setup.goodput
    tokenizer_path = setup.tokenizer_path
    if args.dataset_name in AGENTIC_DATASETS:
        # a deliberate cycle inside bench/: the agentic runner is built on this module's
        # request and metric helpers, and this run dispatches to it for agentic datasets
        from m3serve.bench.agentic_serve import run_from_args

        metrics = await run_from_args(args, setup)
    else:
        requests, warmups = make_requests(args, view, args.num_prompts, args.num_warmups)
        metrics = await benchmark(
            api_url=api_url, model=model, requests=requests, endpoint_type=endpoint_type,
            warmup_requests=warmups, max_concurrency=args.max_concurrency,
            request_rate=args.request_rate, burstiness=args.burstiness, ignore_eos=args.ignore_eos,
            percentiles=percentiles, percentile_metrics=percentile_metrics, goodput=goodput,
            num_gpus=args.num_gpus, seed=args.seed, extra_body=args.extra_body,
            headers=auth_headers(args), disable_tqdm=args.disable_tqdm, sampling=sampling_of(args))
    result = {**config_record(args, model, tokenizer_path, endpoint_type), **metrics}
    if args.save_result:
        label = args.label or result["backend"]
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model_name = model.rstrip("/").split("/")[-1]
        name = args.result_filename or (
            f"{label}-{result['request_rate']}qps{conc}-{model_name}-{result['date']}.json")
        path = save_result(result, os.path.join(args.result_dir or ".", name),
                           args.save_detailed)
        print(f"result saved to {path}")
    return result


def main(args: argparse.Namespace) -> dict:
    """Entry point of `m3serve bench serve`; returns the result dict."""
    return asyncio.run(main_async(args))
