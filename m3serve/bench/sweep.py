"""`m3serve bench sweep`: the concurrency sweep of InferenceX and its chart.

Runs `serve.benchmark` once per concurrency with InferenceX conventions (10 x concurrency
prompts, 2 x concurrency warm-ups, unlimited request rate), or, for the agentic datasets, the
sessions of `agentic_serve` with that many live at once (AgentX); writes one JSON per point plus
a combined JSON, and draws tok/s/GPU (y) against tok/s/user (x; AgentX: P90 E2E-normalised
interactivity), one curve per configuration.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os

from m3serve.bench.agentic_serve import AGENTIC_DETAILED_KEYS, run_from_args
from m3serve.bench.serve import (AGENTIC_DATASETS, DETAILED_KEYS, add_agentic_args, add_common_args,
                                 auth_headers, benchmark, check_dataset_args, config_record,
                                 make_requests, resolve_setup, sampling_of, save_result)


def parse_concurrencies(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]; each a positive integer."""
    try:
        values = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"concurrencies must be comma-separated integers, got {text!r}")
    if not values or any(c < 1 for c in values):
        raise ValueError(f"concurrencies must be integers >= 1, got {text!r}")
    return values


def _import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the sweep chart needs matplotlib: pip install matplotlib "
                          "(or pass --no-plot)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweeps(sweeps: list[dict], path: str) -> str:
    """Draw tok/s/GPU against tok/s/user, one curve per combined sweep result, into `path`
    (against P90 E2E-normalised interactivity, AgentX's x axis, when the first sweep is of
    an agentic dataset).

    Each point is labelled with its concurrency. Raises ImportError naming
    `pip install matplotlib` when matplotlib is missing.
    """
    plt = _import_pyplot()
    agentic = sweeps[0].get("dataset_name") in AGENTIC_DATASETS if sweeps else False
    x_key = "p90_e2e_norm_intvty" if agentic else "tok_per_s_per_user"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for sweep in sweeps:
        points = [p for p in sweep["points"] if p.get(x_key)]
        points.sort(key=lambda p: p[x_key])
        xs = [p[x_key] for p in points]
        ys = [p["tok_per_s_per_gpu"] for p in points]
        ax.plot(xs, ys, marker="o", label=sweep.get("label") or "run")
        for x, y, p in zip(xs, ys, points):
            ax.annotate(str(p["max_concurrency"]), (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    first = sweeps[0] if sweeps else {}
    ax.set_xlabel("P90 E2E-normalised interactivity (tok/s/user)" if agentic
                  else "interactivity (tok/s/user)")
    ax.set_ylabel("throughput (total tok/s/GPU)")
    ax.set_title(f"multi-turn sessions (--dataset-name {first.get('dataset_name')})" if agentic else
                 f"ISL {first.get('random_input_len')} / OSL {first.get('random_output_len')}, "
                 f"range ratio {first.get('random_range_ratio')} ({first.get('range_ratio_mode')})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def print_sweep_table(points: list[dict]) -> None:
    """One line per concurrency: throughput per GPU, interactivity (1 / median TPOT, and
    AgentX's P90 E2E-normalised) and the latencies."""
    print(f"{'conc':>5} {'tok/s/GPU':>10} {'tok/s/user':>10} {'e2e P90':>8} {'med TPOT ms':>11} "
          f"{'med TTFT ms':>11} {'failed':>6}")
    for p in points:
        user, e2e = p["tok_per_s_per_user"], p.get("p90_e2e_norm_intvty")
        print(f"{p['max_concurrency']:>5} {p['tok_per_s_per_gpu']:>10.1f} "
              f"{'n/a' if user is None else format(user, '.1f'):>10} "
              f"{'n/a' if e2e is None else format(e2e, '.1f'):>8} "
              f"{p.get('median_tpot_ms', float('nan')):>11.2f} "
              f"{p.get('median_ttft_ms', float('nan')):>11.2f} {p['failed']:>6}")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """All flags of `m3serve bench sweep` (results are always saved under --result-dir)."""
    add_common_args(parser, inferencex=True)
    parser.add_argument("--concurrencies", default="1,2,4,8,16,32,64,128",
                        help="comma-separated concurrencies, one benchmark point each "
                             "(agentic datasets: live sessions)")
    parser.add_argument("--prompts-per-concurrency", type=int, default=10,
                        help="num_prompts = this x concurrency (InferenceX: 10)")
    parser.add_argument("--warmups-per-concurrency", type=int, default=2,
                        help="uncounted warm-ups = this x concurrency (InferenceX: 2)")
    parser.add_argument("--compare", nargs="*", default=[], metavar="SWEEP_JSON",
                        help="combined JSONs of earlier sweeps to draw as extra curves")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    parser.add_argument("--sessions-per-concurrency", type=int, default=2,
                        help="agentic datasets: sessions per point = this x concurrency, unless "
                             "--agentic-sessions is given")
    add_agentic_args(parser)


async def main_async(args: argparse.Namespace) -> dict:
    """Run the sweep; returns the combined result (configuration + one summary per point)."""
    check_dataset_args(args)
    agentic = args.dataset_name in AGENTIC_DATASETS
    concurrencies = parse_concurrencies(args.concurrencies)
    if agentic and args.sessions_per_concurrency < 1:
        raise ValueError(
            f"sessions_per_concurrency must be >= 1, got {args.sessions_per_concurrency}")
    if args.prompts_per_concurrency < 1:
        raise ValueError(
            f"prompts_per_concurrency must be >= 1, got {args.prompts_per_concurrency}")
    if not args.no_plot:
        _import_pyplot()  # fail before an hour of benchmarking, not after
    compare = []
    for path in args.compare:
        with open(path, encoding="utf-8") as f:
            compare.append(json.load(f))
    setup = await resolve_setup(args)
    api_url, endpoint_type, model, view = setup.api_url, setup.endpoint_type, setup.model, setup.view
    percentiles, percentile_metrics, goodput = setup.percentiles, setup.percentile_metrics, setup.goodput
    tokenizer_path = setup.tokenizer_path
    label = args.label or model.rstrip("/").split("/")[-1]
    result_dir = args.result_dir or "."
    config = config_record(args, model, tokenizer_path, endpoint_type)
    config["label"] = label

    points = []
    for conc in concurrencies:
        # a seed per point: no point's prompts were seen by the server (prefix cache) before
        point_args = argparse.Namespace(**{**vars(args), "seed": args.seed + conc})
        if agentic:
            # AgentX: one run per concurrency = live sessions, played to their end
            point_args.agentic_sessions = (args.agentic_sessions
                                           or args.sessions_per_concurrency * conc)
            point_args.max_concurrency, point_args.request_rate = conc, math.inf
            point_args.burstiness = 1.0
            point_args.num_warmups = args.warmups_per_concurrency * conc
            metrics = await run_from_args(point_args, setup)
            result = {**config, **metrics}
            save_result(result, os.path.join(result_dir, f"{label}-c{conc}.json"),
                        args.save_detailed)
            points.append({k: v for k, v in metrics.items()
                           if k not in DETAILED_KEYS + AGENTIC_DETAILED_KEYS})
            continue
        requests, warmups = make_requests(point_args, view, args.prompts_per_concurrency * conc,
                                          args.warmups_per_concurrency * conc)
        metrics = await benchmark(
            api_url=api_url, model=model, requests=requests, endpoint_type=endpoint_type,
            warmup_requests=warmups, max_concurrency=conc, request_rate=math.inf,
            ignore_eos=args.ignore_eos, percentiles=percentiles,
            percentile_metrics=percentile_metrics, goodput=goodput, num_gpus=args.num_gpus,
            seed=point_args.seed, extra_body=args.extra_body, headers=auth_headers(args),
            disable_tqdm=args.disable_tqdm, sampling=sampling_of(args))
        result = {**config, **metrics}
        save_result(result, os.path.join(result_dir, f"{label}-c{conc}.json"),
                    args.save_detailed)
        points.append({k: v for k, v in metrics.items() if k not in DETAILED_KEYS})

    combined = {**config, "num_gpus": args.num_gpus, "concurrencies": concurrencies,
                "points": points}
    print_sweep_table(points)
    stem = args.result_filename or f"{label}-sweep"
    stem = stem[:-len(".json")] if stem.endswith(".json") else stem
    combined_path = save_result(combined, os.path.join(result_dir, f"{stem}.json"), True)
    print(f"sweep results saved to {combined_path}")
    if not args.no_plot:
        png = plot_sweeps([combined, *compare], os.path.join(result_dir, f"{stem}.png"))
        combined["plot"] = png
        print(f"chart saved to {png}")
    return combined


def main(args: argparse.Namespace) -> dict:
    """Entry point of `m3serve bench sweep`; returns the combined result."""
    return asyncio.run(main_async(args))
