"""`python -m m3serve.bench.step_profile DIR --batch B --isl N`: where a decode step's time goes
(scheduler, model runner, CUDA-graph replay, sampler, output processing) and a kernel table
from torch.profiler, on a real-shape model with dummy weights. For finding bottlenecks."""
from __future__ import annotations

import argparse
import json
import random
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--isl", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quantization", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--mixed", default="",
                   help="comma-separated chunk sizes C: after the decode profile, one new ISL-token "
                        "prompt per C is prefilled beside the decodes, at most C tokens per step, "
                        "and the mixed steps are timed and profiled")
    p.add_argument("--sync-debug", action="store_true",
                   help="with --mixed: list the host syncs inside the mixed steps (their Python stacks)")
    p.add_argument("--prefill", action="store_true",
                   help="profile the first prefill step of the batch's prompts instead (kernel table "
                        "by GPU time and the step's span), then stop")
    p.add_argument("--speculative-config", default=None,
                   help="a draft as `serve --speculative-config` takes it (JSON): the profiled steps "
                        "include the draft's passes (decode steps: no graph-replay split)")
    a = p.parse_args()
    if a.speculative_config and a.mixed:
        p.error("--mixed does not apply with --speculative-config")
    if a.sync_debug and not a.mixed:
        p.error("--sync-debug applies to the mixed steps: give --mixed too")
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams

    llm = LLM(model=a.model, load_format="dummy", max_model_len=a.isl + 1280, max_num_seqs=max(64, a.batch + 1),
              max_num_batched_tokens=16384, quantization=a.quantization, enforce_eager=a.enforce_eager,
              async_scheduling=False,   # steps in turn: this loop drives schedule/execute/update itself
              speculative_config=a.speculative_config)
    eng = llm.engine
    rng = random.Random(0)
    for i in range(a.batch):
        eng.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(2000) for _ in range(a.isl)]},
                        SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    if a.prefill:
        profile_prefill(eng, sync)
        return
    while any(len(s.sequences[0].token_ids) == 0 for s in eng.states.values()):
        eng.step()
    core = eng.core
    graphs = None if a.speculative_config else eng.worker.runner.graphs
    marks = {}
    if graphs is not None:   # time stamps around the replay launch of the graph this batch uses
        g = graphs.graphs[graphs.padded_size(a.batch)][0]
        launch = g.replay

        def timed_replay():
            marks["launch"] = time.perf_counter()
            launch()
            marks["launched"] = time.perf_counter()
        g.replay = timed_replay
    timings = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "front": 0.0,
               "runner_host_before_replay": 0.0, "replay_launch": 0.0, "replay_to_tokens": 0.0}
    for _ in range(a.steps):
        sync(); t0 = time.perf_counter()
        so = core.scheduler.schedule(); t1 = time.perf_counter()
        out = core.executor.execute_model(so); t2 = time.perf_counter()
        outs = core.scheduler.update_from_output(so, out); t3 = time.perf_counter()
        for o in outs:
            state, i = eng._children[o.request_id]
            state.sequences[i].update(o)
        t4 = time.perf_counter()
        split = (marks["launch"] - t1, marks["launched"] - marks["launch"], t2 - marks["launched"]) \
            if marks else (0.0, 0.0, 0.0)
        for k, dt in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, *split)):
            timings[k] += dt * 1e3 / a.steps
    replay_ms = None
    if graphs is not None:
        del g.replay                       # back to the class's method
        sync(); t0 = time.perf_counter()
        for _ in range(a.steps):
            g.replay()
        sync(); replay_ms = (time.perf_counter() - t0) * 1e3 / a.steps
    print(json.dumps({"batch": a.batch, "isl": a.isl, "per_step_ms": {k: round(v, 3) for k, v in timings.items()},
                      "graph_replay_ms": replay_ms and round(replay_ms, 3)}), flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.step()
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print_timeline(eng, sync)
    for chunk in (int(c) for c in a.mixed.split(",") if c):
        profile_mixed(eng, sync, chunk, a.isl, rng, a.sync_debug)


def profile_prefill(eng, sync) -> None:
    """The batch's first engine step (prompt tokens only, up to the step budget): its wall time
    alone, then under the profiler the kernels by GPU time and the span they cover."""
    tokens = sum(len(r.prompt_token_ids) for r in eng.core.scheduler.waiting)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall = _timed_step(eng, sync)
    print(json.dumps({"prefill_step_ms": round(wall, 2), "waiting_prompt_tokens": tokens,
                      "note": "the step ran under the profiler"}), flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    print_trace_summary(prof, "prefill step")


def profile_mixed(eng, sync, chunk: int, isl: int, rng, sync_debug: bool = False) -> None:
    """Prefill one new isl-token prompt beside the running decodes, at most `chunk` of its tokens
    per step: the wall time of each step (synchronised) against the pure decode steps before it,
    then one mixed step's kernel table and timeline. The newcomer is aborted afterwards.
    sync_debug: the third mixed step runs under torch's sync debug mode, and the distinct Python
    stacks of the host syncs it made are printed."""
    from m3serve.sampling_params import SamplingParams
    eng.core.scheduler._long_cap = chunk      # what --long-prefill-token-threshold sets
    decode = [_timed_step(eng, sync) for _ in range(5)]
    req_id = f"mixed{chunk}"
    eng.add_request(req_id, {"prompt_token_ids": [rng.randrange(2000) for _ in range(isl)]},
                    SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    state = eng.states[req_id]
    mixed, profiled = [], False
    while len(state.sequences[0].token_ids) == 0:
        if not profiled and len(mixed) == 1:   # the second chunk: a context before it, like the later ones
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                sync(); t0 = time.perf_counter()
                eng.step()
                sync()
            mixed.append((time.perf_counter() - t0) * 1e3)
            profiled = True
            continue
        if sync_debug and len(mixed) == 2:
            print_syncs(eng, f"mixed step, chunk {chunk}")
            mixed.append(float("nan"))
            continue
        mixed.append(_timed_step(eng, sync))
    eng.abort_request(req_id)
    eng.step()
    print(json.dumps({"mixed_chunk": chunk, "decode_step_ms": [round(x, 2) for x in decode],
                      "mixed_step_ms": [round(x, 2) for x in mixed],
                      "note": "the second mixed step ran under the profiler"}), flush=True)
    if profiled:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
        print_trace_summary(prof, f"mixed step, chunk {chunk}")


def _timed_step(eng, sync) -> float:
    """One engine step's wall time in ms, the GPU idle before and done after it."""
    sync(); t0 = time.perf_counter()
    eng.step()
    sync()
    return (time.perf_counter() - t0) * 1e3


def print_syncs(eng, what: str) -> None:
    """One engine step under torch's sync debug mode: each distinct Python stack (m3serve frames)
    that made a synchronising CUDA call, with its count."""
    import collections
    import traceback
    import warnings
    stacks = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "m3serve" in f.filename]
        stacks[" <- ".join(f"{f.filename.rsplit('m3serve/', 1)[-1]}:{f.lineno}" for f in reversed(frames[-6:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record          # restored when the block exits
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(json.dumps({"what": what, "host_syncs": dict(stacks.most_common())}, indent=1), flush=True)


def _trace_kernels(prof) -> list[dict]:
    """The GPU kernels, copies and fills a profiler recorded, as chrome-trace events by start."""
    import os
    import tempfile
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])


def print_trace_summary(prof, what: str) -> None:
    """GPU busy time against the span of a profiled step's kernels."""
    kernels = _trace_kernels(prof)
    if not kernels:
        return
    start, end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
    busy = sum(e["dur"] for e in kernels)
    print(json.dumps({"what": what, "span_us": round(end - start, 1), "kernel_busy_us": round(busy, 1),
                      "kernels": len(kernels)}), flush=True)


def print_timeline(eng, sync) -> None:
    """One step's GPU kernels in launch order: start offset, duration and the idle gap before each
    (µs), then the totals; the gaps are what launch latency and host work cost inside the step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.step()
        sync()
    kernels = _trace_kernels(prof)
    if not kernels:
        print("timeline: the profiler recorded no kernels")
        return
    t0, end, busy = kernels[0]["ts"], kernels[0]["ts"], 0.0
    print(f"timeline of one step ({len(kernels)} kernels/copies): start  dur  gap  name")
    for e in kernels:
        gap = max(0.0, e["ts"] - end)
        print(f"{e['ts'] - t0:9.1f} {e['dur']:7.1f} {gap:6.1f}  {e['name'][:90]}")
        end, busy = max(end, e["ts"] + e["dur"]), busy + e["dur"]
    span = end - t0
    print(json.dumps({"timeline_span_us": round(span, 1), "kernel_busy_us": round(busy, 1),
                      "idle_us": round(span - busy, 1), "kernels": len(kernels)}))


if __name__ == "__main__":
    main()
