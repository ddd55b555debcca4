"""Serving metrics from per-request records, with the definitions of docs/benchmarks.md.

Pure functions: a list of `RequestRecord` and the benchmark duration in, the result dict out.
Keys follow `vllm bench serve --save-result` (`completed`, `mean_ttft_ms`, `p99_itl_ms`, ...);
`tok_per_s_per_gpu` and `tok_per_s_per_user` are the InferenceX additions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """What the client saw for one request. Times are `time.perf_counter()` seconds.

    `chunk_times` holds the arrival time of every streamed chunk that carried generated text,
    `chunk_tokens` the tokens each carried where the server said (cumulative usage in the
    chunks; else the output is spread evenly over them); `output_tokens` comes from the
    server's `usage.completion_tokens`; `prompt_len` is the server's `usage.prompt_tokens`
    (what it really computed, chat template included), or the dataset's count without usage;
    `cached_tokens` is the server's `usage.prompt_tokens_details.cached_tokens` (prompt tokens
    served from its prefix cache, any tier), None when it does not say.
    """

    prompt_len: int
    start_time: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    success: bool = False
    error: str = ""
    generated_text: str = ""
    cached_tokens: int | None = None

    @property
    def ttft(self) -> float:
        """Start to the first chunk carrying generated text (0.0 when none came)."""
        return self.chunk_times[0] - self.start_time if self.chunk_times else 0.0

    @property
    def e2el(self) -> float:
        """Start to the last chunk carrying generated text."""
        return self.chunk_times[-1] - self.start_time if self.chunk_times else 0.0

    @property
    def itl(self) -> list[float]:
        """Gaps between successive text-carrying chunks."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output_tokens - 1); None when the request made <= 1 token."""
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(
                f"goodput must be NAME:MS with NAME in ttft, tpot, e2el; got {pair!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput value must be a number of ms, got {pair!r}") from None
        if slos[name] < 0:
            raise ValueError(f"goodput value must be >= 0 ms, got {pair!r}")
    return slos


def parse_percentiles(text: str) -> list[float]:
    """"50,90,99" -> [50.0, 90.0, 99.0], each within [0, 100]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"metric_percentiles must be comma-separated numbers, got {text!r}")
    if not values or any(not 0.0 <= p <= 100.0 for p in values):
        raise ValueError(f"metric_percentiles must be numbers in [0, 100], got {text!r}")
    return values


def parse_percentile_metrics(text: str) -> list[str]:
    """"ttft,tpot" -> ["ttft", "tpot"], each one of METRIC_NAMES."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRIC_NAMES]
    if not names or bad:
        raise ValueError(f"percentile_metrics must name some of {METRIC_NAMES}, got {text!r}")
    return names


def percentile_key(p: float) -> str:
    """99.0 -> "p99", 99.9 -> "p99.9" (vLLM's naming)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _stats_ms(values_s: list[float], percentiles) -> dict[str, float]:
    # An empty list reports zeros, as vLLM does, so the JSON always has every key.
    arr = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(arr, p))
    return out


def e2e_normalized_interactivity(records: list[RequestRecord], percentiles=DEFAULT_PERCENTILES
                                 ) -> dict[str, float | None]:
    """InferenceX AgentX's E2E-normalised interactivity, in output tokens/s/user.

    Per successful request r = E2EL / output tokens (seconds per delivered token, TTFT
    included); the statistic of the r values is taken first and then inverted, so
    `p90_e2e_norm_intvty` = 1 / P90(r) is the slow tail (mean and median likewise). Requests
    with no output or no positive E2EL are skipped; None when none is left.
    """
    ratios = [r.e2el / r.output_tokens for r in records
              if r.success and r.output_tokens > 0 and r.e2el > 0]
    stats = {"mean": float(np.mean(ratios)) if ratios else None,
             "median": float(np.median(ratios)) if ratios else None}
    for p in percentiles:
        stats[percentile_key(p)] = float(np.percentile(ratios, p)) if ratios else None
    return {f"{name}_e2e_norm_intvty": (1.0 / v if v else None) for name, v in stats.items()}


def _peak_output_rate(records: list[RequestRecord]) -> tuple[float, int]:
    """Most output tokens received in one whole second (from the run's start), and the exact
    peak of requests in flight at once (each over [start, last chunk))."""
    if not records:
        return 0.0, 0
    t0 = min(r.start_time for r in records)
    t1 = max(r.chunk_times[-1] if r.chunk_times else r.start_time for r in records)
    tokens = np.zeros(int(math.ceil(t1 - t0)) + 1)
    events = []
    for r in records:
        counts = r.chunk_tokens if len(r.chunk_tokens) == len(r.chunk_times) else (
            [r.output_tokens / len(r.chunk_times)] * len(r.chunk_times) if r.chunk_times else [])
        for t, n in zip(r.chunk_times, counts):
            tokens[int(t - t0)] += n
        end = r.chunk_times[-1] if r.chunk_times else r.start_time
        if end > r.start_time:
            events += [(r.start_time, 1), (end, -1)]
    active = peak = 0
    for _, step in sorted(events):           # at a tie the end (-1) sorts first: [start, end)
        active += step
        peak = max(peak, active)
    return float(tokens.max()), peak


def compute_metrics(records: list[RequestRecord], duration_s: float, *,
                    percentiles=DEFAULT_PERCENTILES, percentile_metrics=METRIC_NAMES,
                    goodput: dict[str, float] | None = None, num_gpus: int = 1) -> dict:
    """The benchmark result dict for `records` over a run of `duration_s` seconds.

    Only successful requests enter the latency statistics and token sums; failed ones are
    counted in `failed`, keep their error text in `errors` and report 0 output tokens.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.e2el for r in ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [gap for r in ok for gap in r.itl]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)

    good = None
    if goodput:
        slo_s = {name: ms / 1000.0 for name, ms in goodput.items()}
        num_good = 0
        for r in ok:
            # A request with <= 1 output token has no TPOT; it cannot miss a TPOT SLO.
            measured = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
            num_good += all(measured[name] <= limit for name, limit in slo_s.items())
        good = num_good / duration_s

    peak_rate, peak_active = _peak_output_rate(ok)
    t_first = min((r.start_time for r in records), default=0.0)
    result = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
        "max_output_tokens_per_s": peak_rate,
        "max_concurrent_requests": peak_active,
        # saved by default, as vLLM does: per-request E2EL and send time (s, from the first send)
        "latencies": [r.e2el for r in records],
        "start_times": [r.start_time - t_first for r in records] if records else [],
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in percentile_metrics:
        for stat, value in _stats_ms(series[name], percentiles).items():
            result[f"{stat}_{name}_ms"] = value

    result.update(e2e_normalized_interactivity(ok, sorted(set(percentiles) | {90.0})))

    median_tpot_ms = float(np.median(tpots)) * 1000.0 if tpots else 0.0
    result["num_gpus"] = num_gpus
    result["tok_per_s_per_gpu"] = result["total_token_throughput"] / num_gpus
    result["output_tok_per_s_per_gpu"] = result["output_throughput"] / num_gpus
    result["tok_per_s_per_user"] = 1000.0 / median_tpot_ms if median_tpot_ms > 0 else None
    return result
