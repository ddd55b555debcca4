"""The agentic multi-turn benchmark run: sessions against a server, and what they measured.

Owns the session loop (each turn re-sends the conversation with the model's actual replies,
waits its think time after the previous reply, many sessions interleaved under a live-session
cap and a session arrival rate), the prefix-cache counters read from the server's Prometheus
/metrics before and after (GPU tier and CPU/external tier; m3serve's or vLLM's names), and the
agentic result: TTFT by turn index, E2E-normalised interactivity, hit rates and re-prefilled
tokens. Definitions: docs/benchmarks.md section 8.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import numpy as np

from m3serve.bench.agentic import Conversation, SessionSpec
from m3serve.bench.metrics import (DEFAULT_PERCENTILES, METRIC_NAMES, RequestRecord, _stats_ms,
                                   compute_metrics)
from m3serve.bench.serve import (Target, arrival_offsets, metric_lines, metrics_text, print_summary,
                                 send_request)

# per-request lists of an agentic result (kept out of a sweep's combined JSON)
AGENTIC_DETAILED_KEYS = ("turn_indices", "session_ids", "cached_tokens", "new_context_tokens")

# counter name (without prefix and _total) -> key in the snapshot
_PREFIX_CACHE_COUNTERS = {
    "prefix_cache_queries": "gpu_queries",
    "prefix_cache_hits": "gpu_hits",
    "external_prefix_cache_queries": "cpu_queries",
    "external_prefix_cache_hits": "cpu_hits",
    "num_preemptions": "preemptions",
}


def parse_prefix_cache_counters(text: str) -> dict[str, float] | None:
    """The prefix-cache counters of a Prometheus text exposition, summed over label sets.

    Keys: gpu_queries, gpu_hits and, when the server has a CPU/external tier, cpu_queries and
    cpu_hits. Accepts `m3serve:` and `vllm:` names (one family, see `metric_lines`), with or
    without the `_total` suffix. None when the text has no GPU prefix-cache counters (prefix
    caching off, or another server).
    """
    out: dict[str, float] = {}
    for name, _, value in metric_lines(text):
        key = _PREFIX_CACHE_COUNTERS.get(name.removesuffix("_total"))
        if key is not None:
            out[key] = out.get(key, 0.0) + value
    return out if "gpu_queries" in out and "gpu_hits" in out else None


async def prefix_cache_counters(api_url: str, headers: dict) -> dict[str, float] | None:
    """The server's prefix-cache counters now (see parse_prefix_cache_counters); None when it
    has no /metrics or no such counters."""
    text = await metrics_text(api_url, headers)
    return None if text is None else parse_prefix_cache_counters(text)


@dataclass
class TurnRecord:
    """One turn as sent: its session, its index in the session, what the client saw, and the
    tokens a perfect prefix cache would still have to prefill (`new_context_tokens`: the whole
    prompt on a session's first turn or after a reset, else this prompt minus the previous
    turn's prompt and reply)."""

    session_id: str
    turn: int
    record: RequestRecord
    reset: bool = False
    new_context_tokens: int = 0


async def _run_session(target: Target, session: SessionSpec, texts: list[str],
                       out: list[TurnRecord], pbar) -> bool:
    """Play one session to its end; a failed turn ends it (the next turn needs the reply).
    Returns whether every turn succeeded."""
    conversation = Conversation(target.endpoint_type)
    previous: RequestRecord | None = None
    for k, (turn, text) in enumerate(zip(session.turns, texts)):
        if k and turn.think_time_s > 0:
            await asyncio.sleep(turn.think_time_s)
        if turn.reset:
            conversation.reset()
        conversation.add_user(text)
        record = await send_request(target, conversation.request(turn.output_len))
        if pbar is not None:
            pbar.update(1)
        fresh = k == 0 or turn.reset or previous is None
        new = record.prompt_len if fresh else max(
            record.prompt_len - previous.prompt_len - previous.output_tokens, 0)
        out.append(TurnRecord(session.session_id, k, record, turn.reset, new))
        if not record.success:
            return False
        conversation.add_reply(record.generated_text)
        previous = record
    return True


async def run_sessions(target: Target, sessions: list[SessionSpec], texts: list[list[str]],
                       offsets, max_concurrency: int | None, pbar=None) -> tuple[list[TurnRecord], int]:
    """Start session i at offsets[i] (seconds from now) once fewer than `max_concurrency`
    sessions are live (a session holds its slot through its think times, as an AgentX lane
    does). Returns the turn records in completion order and the number of sessions that ended
    early on a failed turn."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()
    records: list[TurnRecord] = []

    async def one(session: SessionSpec, session_texts: list[str], offset: float) -> bool:
        delay = offset - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        if semaphore is None:
            return await _run_session(target, session, session_texts, records, pbar)
        async with semaphore:
            return await _run_session(target, session, session_texts, records, pbar)

    done = await asyncio.gather(*(one(s, t, float(o)) for s, t, o in zip(sessions, texts, offsets)))
    return records, sum(not ok for ok in done)


def per_turn_stats(turns: list[TurnRecord], percentiles=DEFAULT_PERCENTILES) -> list[dict]:
    """One entry per turn index (successful requests only): TTFT statistics in ms, and mean
    prompt / new-context / cached / re-prefilled tokens (cached and re-prefilled from the
    server's usage.prompt_tokens_details.cached_tokens; None when it does not report it)."""
    by_turn: dict[int, list[TurnRecord]] = {}
    for t in turns:
        if t.record.success:
            by_turn.setdefault(t.turn, []).append(t)
    return [_turn_group_stats(k, by_turn[k], percentiles) for k in sorted(by_turn)]


def returning_turn_stats(turns: list[TurnRecord], percentiles=DEFAULT_PERCENTILES) -> dict | None:
    """The same statistics pooled over every returning turn (turn index >= 1, successful): the
    turns a prefix cache can serve, and the figure a CPU tier is judged by. None without any."""
    group = [t for t in turns if t.record.success and t.turn >= 1]
    return _turn_group_stats("1+", group, percentiles) if group else None


def _turn_group_stats(key, group: list[TurnRecord], percentiles) -> dict:
    percentiles = sorted(set(percentiles) | {90.0})     # P90 by turn is always reported
    row = {"turn": key, "num_requests": len(group)}
    for stat, value in _stats_ms([t.record.ttft for t in group], percentiles).items():
        row[f"{stat}_ttft_ms"] = value
    row["mean_prompt_tokens"] = float(np.mean([t.record.prompt_len for t in group]))
    row["mean_new_context_tokens"] = float(np.mean([t.new_context_tokens for t in group]))
    cached = [t.record.cached_tokens for t in group]
    if all(c is not None for c in cached):
        row["mean_cached_tokens"] = float(np.mean(cached))
        row["mean_reprefilled_tokens"] = float(np.mean(
            [t.record.prompt_len - t.record.cached_tokens for t in group]))
    else:
        row["mean_cached_tokens"] = row["mean_reprefilled_tokens"] = None
    return row


def prefix_cache_summary(turns: list[TurnRecord], before: dict | None, after: dict | None) -> dict:
    """Hit rates per tier and re-prefilled tokens of the run.

    From the counter deltas: per tier queries, hits and hits / queries (CPU keys None when the
    server has no CPU tier; all None without counters). `prompt_tokens_sent` sums the server's
    usage.prompt_tokens of the successful turns; `reprefilled_tokens` = sent − GPU hits − CPU
    hits; `ideal_prefill_tokens` sums each turn's new context (what a cache that never evicts
    would still prefill), and `excess_reprefilled_tokens` is what the run prefilled beyond it.
    The same from the requests' usage: `usage_cached_tokens` (Σ cached_tokens, counted once per
    request) and `usage_reprefilled_tokens`; plus the server's preemptions in the run and
    `prefix_cache_lookups_per_prompt_token` (GPU queries / sent; above 1 the server counted
    repeated lookups, and its hits are then not all prefill saved).
    """
    ok = [t for t in turns if t.record.success]
    sent = sum(t.record.prompt_len for t in ok)
    ideal = sum(t.new_context_tokens for t in ok)
    cached = [t.record.cached_tokens for t in ok]
    usage_cached = sum(cached) if ok and all(c is not None for c in cached) else None
    out: dict = {"prompt_tokens_sent": sent, "ideal_prefill_tokens": ideal,
                 "usage_cached_tokens": usage_cached,
                 "usage_reprefilled_tokens": None if usage_cached is None else sent - usage_cached}
    have = before is not None and after is not None
    out["num_preemptions"] = (int(after["preemptions"] - before.get("preemptions", 0.0))
                              if have and "preemptions" in after else None)
    for tier in ("gpu", "cpu"):
        present = have and f"{tier}_queries" in after and f"{tier}_hits" in after
        queries = after[f"{tier}_queries"] - before.get(f"{tier}_queries", 0.0) if present else None
        hits = after[f"{tier}_hits"] - before.get(f"{tier}_hits", 0.0) if present else None
        out[f"prefix_cache_queries_{tier}"] = None if queries is None else int(queries)
        out[f"prefix_cache_hits_{tier}"] = None if hits is None else int(hits)
        out[f"prefix_cache_hit_rate_{tier}"] = (hits / queries if queries else 0.0) if present else None
    if have:
        hits = out["prefix_cache_hits_gpu"] + (out["prefix_cache_hits_cpu"] or 0)
        out["prefix_cache_hit_tokens"] = hits
        out["prefix_cache_hit_rate"] = hits / sent if sent else 0.0
        out["reprefilled_tokens"] = sent - hits
        out["reprefilled_fraction"] = (sent - hits) / sent if sent else 0.0
        out["excess_reprefilled_tokens"] = sent - hits - ideal
        # > 1 when the server looked prompts up more than once (admission retried for want of
        # blocks, preemption): its hit counters then overstate the hits that saved prefill
        out["prefix_cache_lookups_per_prompt_token"] = (out["prefix_cache_queries_gpu"] / sent
                                                        if sent else None)
    else:
        for key in ("prefix_cache_hit_tokens", "prefix_cache_hit_rate", "reprefilled_tokens",
                    "reprefilled_fraction", "excess_reprefilled_tokens",
                    "prefix_cache_lookups_per_prompt_token"):
            out[key] = None
    return out


async def benchmark_agentic(*, api_url: str, model: str, sessions: list[SessionSpec],
                            texts: list[list[str]], endpoint_type: str = "completions",
                            max_concurrency: int | None = None, session_rate: float = math.inf,
                            burstiness: float = 1.0, ignore_eos: bool = True,
                            percentiles=DEFAULT_PERCENTILES, percentile_metrics=METRIC_NAMES,
                            goodput: dict[str, float] | None = None, num_gpus: int = 1,
                            seed: int = 0, extra_body: dict | None = None,
                            headers: dict | None = None, disable_tqdm: bool = False,
                            show_summary: bool = True, sampling: dict | None = None) -> dict:
    """Play `sessions` (turn texts `texts`) against `api_url`; returns the result dict: the
    serving metrics of every turn request (as `benchmark`), plus `per_turn`, the session
    counts and the prefix-cache figures of `prefix_cache_summary`."""
    from tqdm import tqdm

    if not sessions:
        raise ValueError("sessions must not be empty")
    if len(texts) != len(sessions):
        raise ValueError(f"texts has {len(texts)} sessions, sessions has {len(sessions)}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    offsets = arrival_offsets(len(sessions), session_rate, burstiness, seed)
    target = Target(api_url, model, endpoint_type, ignore_eos, extra_body, headers or {}, sampling)
    num_turns = sum(len(s.turns) for s in sessions)
    pbar = None if disable_tqdm else tqdm(total=num_turns, desc="turns")
    before = await prefix_cache_counters(api_url, headers or {})
    start = time.perf_counter()
    turns, num_aborted = await run_sessions(target, sessions, texts, offsets, max_concurrency, pbar)
    duration = time.perf_counter() - start
    after = await prefix_cache_counters(api_url, headers or {})
    if pbar is not None:
        pbar.close()
    turns.sort(key=lambda t: t.record.start_time)
    result = compute_metrics([t.record for t in turns], duration, percentiles=percentiles,
                             percentile_metrics=percentile_metrics, goodput=goodput,
                             num_gpus=num_gpus)
    result.update({
        "num_prompts": len(turns),
        "num_sessions": len(sessions),
        "num_planned_turns": num_turns,
        "num_sessions_aborted": num_aborted,
        "max_concurrency": max_concurrency,
        "request_rate": "inf" if math.isinf(session_rate) else session_rate,
        "burstiness": burstiness,
        "turn_indices": [t.turn for t in turns],
        "session_ids": [t.session_id for t in turns],
        "cached_tokens": [t.record.cached_tokens for t in turns],
        "new_context_tokens": [t.new_context_tokens for t in turns],
        "per_turn": per_turn_stats(turns, percentiles),
        "returning_turns": returning_turn_stats(turns, percentiles),
        **prefix_cache_summary(turns, before, after),
    })
    if show_summary:
        print_summary(result, percentiles, percentile_metrics)
        print_agentic_summary(result)
    return result


def print_agentic_summary(result: dict) -> None:
    """The agentic figures below the serving summary: sessions, interactivity, cache, by turn."""
    def row(label: str, value, fmt: str = ".2f") -> None:
        text = "n/a" if value is None else (format(value, fmt) if fmt else str(value))
        print(f"{label:<40} {text:<10}")

    print("{:-^60}".format("Agentic sessions"))
    row("Sessions (aborted):", f"{result['num_sessions']} ({result['num_sessions_aborted']})", "")
    row("E2E-norm. interactivity P90 (tok/s):", result.get("p90_e2e_norm_intvty"))
    row("Prompt tokens sent:", result["prompt_tokens_sent"], "")
    row("GPU prefix-cache hit rate:", result["prefix_cache_hit_rate_gpu"], ".3f")
    row("CPU prefix-cache hit rate:", result["prefix_cache_hit_rate_cpu"], ".3f")
    row("Re-prefilled tokens:", result["reprefilled_tokens"], "")
    row("Re-prefilled tokens (usage):", result["usage_reprefilled_tokens"], "")
    row("Ideal prefill tokens (no eviction):", result["ideal_prefill_tokens"], "")
    row("Preemptions:", result["num_preemptions"], "")
    lookups = result.get("prefix_cache_lookups_per_prompt_token")
    if lookups is not None and lookups > 1.001:
        print(f"note: the server looked prompts up {lookups:.2f} times per token sent (admissions "
              "retried, preemptions); its hit counters overstate the hits that saved prefill, "
              "see the usage figures")
    print(f"{'turn':>4} {'n':>5} {'mean TTFT':>10} {'med TTFT':>9} {'P90 TTFT':>9} "
          f"{'prompt':>8} {'new ctx':>8} {'re-prefill':>10}")
    returning = [result["returning_turns"]] if result.get("returning_turns") else []
    for t in result["per_turn"] + returning:
        re = t["mean_reprefilled_tokens"]
        print(f"{t['turn']:>4} {t['num_requests']:>5} {t['mean_ttft_ms']:>10.1f} "
              f"{t['median_ttft_ms']:>9.1f} {t['p90_ttft_ms']:>9.1f} "
              f"{t['mean_prompt_tokens']:>8.0f} {t['mean_new_context_tokens']:>8.0f} "
              f"{'n/a' if re is None else format(re, '.0f'):>10}")
    print("=" * 60)


def workload_from_args(args, view) -> tuple[list[SessionSpec], list[list[str]], dict]:
    """The sessions, their turn texts and the workload's record for the result JSON, from the
    `--dataset-name agentic | agentic-trace` flags of `bench serve`."""
    from m3serve.bench.agentic import SyntheticConfig, generate_sessions, load_trace, turn_texts

    for name in ("agentic_sessions", "agentic_turns"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.dataset_name == "agentic-trace":
        if not (args.agentic_max_think_time >= 0):
            raise ValueError(f"--agentic-max-think-time must be >= 0, got {args.agentic_max_think_time}")
        sessions = load_trace(args.dataset_path, args.agentic_max_think_time,
                              args.agentic_sessions, args.agentic_turns)
        record = {"agentic_max_think_time_s": args.agentic_max_think_time}
    else:
        config = SyntheticConfig(
            num_sessions=args.agentic_sessions or SyntheticConfig.num_sessions,
            num_turns=args.agentic_turns or SyntheticConfig.num_turns,
            min_turns=args.agentic_min_turns, first_input_len=args.agentic_first_input_len,
            new_tokens_median=args.agentic_new_tokens, new_tokens_sigma=args.agentic_new_tokens_sigma,
            output_len_median=args.agentic_output_len, output_len_sigma=args.agentic_output_len_sigma,
            think_time_median_s=args.agentic_think_time,
            think_time_sigma=args.agentic_think_time_sigma,
            max_think_time_s=args.agentic_max_think_time)
        sessions = generate_sessions(config, args.seed)
        record = {"agentic": {k: getattr(config, k) for k in config.__dataclass_fields__}}
    return sessions, turn_texts(view, sessions, args.seed), record


async def run_from_args(args, setup) -> dict:
    """`bench serve` on an agentic dataset: warm-ups (random prompts, not counted), then the
    sessions; returns the metrics plus the workload's record."""
    from m3serve.bench.serve import auth_headers, make_requests, sampling_of

    sessions, texts, record = workload_from_args(args, setup.view)
    headers = auth_headers(args)
    target = Target(setup.api_url, setup.model, setup.endpoint_type, args.ignore_eos,
                    args.extra_body, headers, sampling_of(args))
    if args.num_warmups:
        _, warmups = make_requests(args, setup.view, 1, args.num_warmups)
        warm = await asyncio.gather(*(send_request(target, r) for r in warmups))
        if not any(r.success for r in warm):
            raise RuntimeError(f"all {len(warm)} warm-up requests failed; first error: {warm[0].error}")
    metrics = await benchmark_agentic(
        api_url=setup.api_url, model=setup.model, sessions=sessions, texts=texts,
        endpoint_type=setup.endpoint_type, max_concurrency=args.max_concurrency,
        session_rate=args.request_rate, burstiness=args.burstiness, ignore_eos=args.ignore_eos,
        percentiles=setup.percentiles, percentile_metrics=setup.percentile_metrics,
        goodput=setup.goodput, num_gpus=args.num_gpus, seed=args.seed,
        extra_body=args.extra_body, headers=headers, disable_tqdm=args.disable_tqdm,
        sampling=sampling_of(args))
    return {**record, **metrics}
