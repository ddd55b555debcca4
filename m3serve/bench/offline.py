"""`m3serve bench offline`: prefill time and TPOT of the offline engine at given (ISL, batch)
points, with MBU against the decode roofline using the measured number of distinct experts per
MoE layer and the prefill MFU. Prints one JSON line per point. Two TPOTs:

- `tpot_peer_ms`: the vLLM peer script's method (a run of OSL + 1 tokens, minus the time of a
  max_tokens=1 run of the same shapes, divided by OSL): the figure to set beside vLLM's;
- `tpot_ms`: docs/benchmarks.md's per-request TPOT, (last token time - first token time) /
  (tokens - 1) averaged over requests, which also carries the mixed prefill+decode steps a
  request waits through when the batch's prompts take several steps to prefill.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from m3serve.engine_args import add_engine_args
    parser.add_argument("--points", nargs="+", default=["1024:1,8"],
                        help="ISL:batch,batch,... groups, e.g. 1024:1,8,32 8192:4,16")
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of the measured runs (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    add_engine_args(parser)


def _expert_ids(llm, recorder) -> list:
    """Copies of each target MoE layer's last expert choices [T, K] as `recorder` (the probe the
    bench installs, layers/probes.py) last received them (graph replays overwrite them), in
    layer order, None for a layer not run yet; none when the engine runs in its own processes."""
    from m3serve.layers.probes import ROUTED_EXPERTS
    if llm.engine.worker is None:
        return []
    latest = recorder.latest(ROUTED_EXPERTS)
    ids = [i for i, layer in enumerate(llm.engine.worker.model.model.layers) if layer.is_moe]
    return [latest[i].clone() if i in latest else None for i in ids]


def _count(ids, cfg) -> float:
    """Distinct experts this rank holds among one layer's choices (a tensor [T, K], or None):
    all of them, or under an expert-parallel view only those in its range."""
    if ids is None:
        return 0.0
    ids = ids.unique()
    if cfg.expert_view is not None:
        rank, size = cfg.expert_view
        per = cfg.num_local_experts // size
        ids = ids[(ids >= rank * per) & (ids < (rank + 1) * per)]
    return float(ids.numel())


# tokens each request of a point's warm-up decodes under the measured speculation gate: its
# bucket times each width of drafts and plain steps (17 decode-only steps for DSpark's k = 7,
# core/spec_gate.py) after the steps that share prompt chunks, which at 16 requests of 8K
# tokens take half of a 48-token warm-up
GATE_WARM_UP_TOKENS = 96


def _spec_counts(llm) -> tuple | None:
    """(verify steps with drafts, draft tokens, accepted tokens, steps the gate ran without
    drafts, of them deferred (async scheduling), steps that only landed deferred tokens before
    drafts, steps by the drafts each request verified (a Counter; 0: the step only proposed);
    the last four in-process only, else 0 / empty) so far; None without drafts."""
    if not llm.engine.config.speculative.enabled:
        return None
    if llm.engine.core is not None:
        sched = llm.engine.core.scheduler
        st = sched.spec_stats
        return (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, sched.num_plain_steps,
                sched.num_deferred_steps, sched.num_landing_steps, Counter(sched.num_steps_by_width))
    states = llm.engine.engine_states()
    return (sum(s.spec_num_drafts for s in states), sum(s.spec_num_draft_tokens for s in states),
            sum(s.spec_num_accepted_tokens for s in states), 0, 0, 0, Counter())


def _step_arm_counts(eng) -> tuple | None:
    """(plain steps, landing steps, steps by width) the in-process scheduler has counted so far
    (without drafts: its steps); None out of process."""
    if eng.core is None:
        return None
    sched = eng.core.scheduler
    if not eng.config.speculative.enabled:        # every step is a plain one
        runner = eng.worker.runner
        return runner.num_graph_steps + runner.num_eager_steps, 0, {}
    return sched.num_plain_steps, sched.num_landing_steps, dict(sched.num_steps_by_width)


def _add_step_time(times: dict, running: int, before: tuple, after: tuple, seconds: float) -> str:
    """Add one engine step's wall time under "<running requests>/<arm>": plain, land (a step
    that only landed deferred tokens), wJ (J drafts verified; w0: a switch step that only
    proposed), idle (no step scheduled) or mixed (several in one call); returns the key."""
    arms = []
    if after[0] > before[0]:
        arms.append("plain")
    if after[1] > before[1]:
        arms.append("land")
    arms += [f"w{w}" for w, n in after[2].items() if n > before[2].get(w, 0)]
    key = f"{running}/{arms[0] if len(arms) == 1 else 'mixed' if arms else 'idle'}"
    n, total = times.get(key, (0, 0.0))
    times[key] = (n + 1, total + seconds)
    return key


def _slowest(steps: list, n: int = 6) -> list[dict]:
    """The n slowest of (seconds, "<running>/<arm>", requests prefilling, graph replays, eager
    forwards) step records, as JSON-ready dicts."""
    return [{"ms": round(t * 1e3, 1), "step": k, "prefilling": p, "graph": g, "eager": e}
            for t, k, p, g, e in sorted(steps, reverse=True)[:n]]


def _num_prefilling(eng) -> int | None:
    """Running requests with prompt tokens still to compute (in-process only)."""
    if eng.core is None:
        return None
    sched = eng.core.scheduler
    return sum(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)


def _step_time_summary(times: dict) -> dict:
    """{"<running>/<arm>": [steps, total ms]} ordered by running requests then arm: where a
    run's decode time went (`_add_step_time`)."""
    def order(key):
        running, arm = key.split("/")
        return -int(running), arm
    return {k: [times[k][0], round(times[k][1] * 1e3, 1)] for k in sorted(times, key=order)}


def _gate_rule(llm) -> str | None:
    """The in-process engine's rule for which steps speculate (None: no drafts, or not known)."""
    core = llm.engine.core
    if core is None or not llm.engine.config.speculative.enabled:
        return None
    return core.scheduler.spec_gate.rule


def _spec_figures(llm, before) -> dict:
    """Mean acceptance length (tokens per verify step) of the measured runs, their steps by the
    drafts each request verified, and where the gate stands after them (in-process only)."""
    after = _spec_counts(llm)
    if before is None or after is None:
        return {}
    drafts, tokens, accepted, plain, deferred, landing = (a - b for a, b in zip(after[:6], before[:6]))
    widths = after[6] - before[6]
    gate = llm.engine.core.scheduler.spec_gate if llm.engine.core is not None else None
    return {"spec_verify_steps": drafts, "spec_draft_tokens": tokens, "spec_plain_steps": plain,
            "spec_deferred_steps": deferred, "spec_landing_steps": landing,
            "spec_steps_by_width": {str(w): n for w, n in sorted(widths.items())},
            "spec_gate": _gate_rule(llm),
            **({"spec_gate_state": gate.summary()} if gate is not None and gate.rule == "measured" else {}),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None}


def _graph_kernels(runner, bs: int) -> dict | None:
    """The decode graph of batch `bs`'s kernels (total, per MoE layer, by class), read from the
    captured graph (worker/graph_nodes.py); None without one (eager, engine processes)."""
    graphs = runner.graphs if runner is not None else None
    if graphs is None or (size := graphs.padded_size(bs)) is None:
        return None
    counts = graphs.node_counts.get(size)
    return dict(counts, graph_batch=size) if counts else None


def _expected_experts(cfg, tokens: int) -> list[float]:
    """E_held x (1 - (1 - k/E)^tokens) per MoE layer: distinct experts of balanced random
    routing among the E_held this model holds (all E, or E / size under an expert view)."""
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    held = E // cfg.expert_view[1] if cfg.expert_view else E
    n = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    return [held * (1 - (1 - k / E) ** tokens)] * n


def _packed_weight_bytes(llm, default: float) -> tuple[float, float]:
    """(bytes per element of the attention / dense linear weights, of the experts' weights) as
    the model holds them: packed codes plus scales where packed (`--quantization mxfp8 | mxfp4
    | nvfp4` or a quantised checkpoint), else `default`. Read from the in-process model, or
    from the online quantization's name when the model lives in rank processes."""
    from m3serve.bench.roofline import PACKED_BYTES
    q = llm.engine.config.model.quantization
    if llm.engine.worker is None:
        return ((PACKED_BYTES["mxfp8"],) * 2 if q == "mxfp8"
                else (default, PACKED_BYTES[q]) if q in ("mxfp4", "nvfp4") else (default, default))
    from m3serve.layers.packed import packed_format
    layers = llm.engine.worker.model.model.layers
    moe = next((layer.mlp for layer in layers if layer.is_moe), None)
    attn = packed_format(layers[0].self_attn.qkv_proj, "weight")
    experts = packed_format(moe.experts, "w13") if moe is not None else None
    return (PACKED_BYTES[attn.kind] if attn else default,
            PACKED_BYTES[experts.kind] if experts else default)


def as_asked(bs: int, max_running: int | None, full_steps: int, decode_steps: int) -> str | None:
    """None when the point ran as asked (all `bs` sequences decoding together for most decode
    steps), else why not: e.g. preemption or KV capacity kept fewer running at once, so its
    TPOT is not the TPOT of batch `bs`."""
    if max_running is None:
        return None                           # engine processes: not observable from here
    if max_running < bs:
        return f"at most {max_running} of {bs} sequences ran together (KV capacity or preemption)"
    if decode_steps and full_steps < decode_steps // 2:
        return (f"all {bs} sequences ran together in only {full_steps} of {decode_steps} steps "
                f"(KV capacity or preemption)")
    return None


def run_params(args, max_tokens: int):
    """The sampling of every run: max_tokens tokens past EOS, greedy or `--temperature` /
    `--top-p`."""
    from m3serve.sampling_params import SamplingParams
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=args.temperature,
                          top_p=args.top_p)


def main(args) -> list[dict]:
    import torch

    from m3serve.bench.jit_stats import new_variants, variants_by_kernel
    from m3serve.bench.roofline import (BF16_TFLOPS, FP8_TFLOPS, decode_floor_ms, decode_step_bytes,
                                        prefill_flops)
    from m3serve.engine_args import engine_kwargs
    from m3serve.layers import probes
    from m3serve.llm import LLM

    t0 = time.time()
    llm = LLM(**engine_kwargs(args))
    cfg = llm.engine.model_config
    in_process = llm.engine.worker is not None
    print(json.dumps({"startup_s": round(time.time() - t0, 1), "layers": cfg.num_hidden_layers,
                      "executor": "uni (in-process)" if in_process else
                      f"mp ({llm.engine.config.parallel.world_size} rank process(es))",
                      "device": str(llm.engine.worker.device) if in_process else "rank processes"}),
          flush=True)
    fp8 = llm.engine.config.model.quantization == "fp8"
    wbytes, peak = (1.0, FP8_TFLOPS) if fp8 else (2.0, BF16_TFLOPS)
    wbytes, ebytes = _packed_weight_bytes(llm, wbytes)
    kvbytes = 1.0 if llm.engine.config.cache.kv_cache_dtype.startswith("fp8") else 2.0
    rng = random.Random(0)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    results = []
    points = []
    for group in args.points:
        try:
            isl, batches = group.split(":")
            points += [(int(isl), int(b)) for b in batches.split(",")]
        except ValueError:
            raise ValueError(f"--points: expected ISL:batch,batch,..., got {group!r}") from None
    # the MoE layers report their expert choices to this probe (the measured roofline's count)
    recorder = probes.Recorder(keep_all=False)
    with probes.installed(recorder):
        for isl, bs in points:
            def prompts():
                return [{"prompt_token_ids": [rng.randrange(0, 2000) for _ in range(isl)]} for _ in range(bs)]
            one, many = run_params(args, 1), run_params(args, args.osl + 1)
            # warm-up with the same shapes, decode and mixed prefill+decode steps included, so that
            # no Triton JIT specialisation is compiled inside a measured step; under the measured
            # speculation gate long enough for the batch's bucket to time every arm and choose, as
            # in a server that has run a while (core/spec_gate.py)
            warm_up = GATE_WARM_UP_TOKENS if _gate_rule(llm) == "measured" else 4
            llm.generate(prompts(), run_params(args, warm_up), use_tqdm=False)
            jit_before = variants_by_kernel()
            spec_before = _spec_counts(llm)
            batch = prompts()
            sync(); a = time.perf_counter()
            llm.generate(batch, one, use_tqdm=False)
            sync(); prefill = time.perf_counter() - a
            # decode: TPOT per request = (last token time - first token time) / (tokens - 1)
            eng = llm.engine
            batch = prompts()
            sync(); started = time.perf_counter()
            for i, pr in enumerate(batch):
                eng.add_request(f"bench-{isl}-{bs}-{i}", pr, many.clone(), defer_admission=True)
            eng.settle()
            first, last, ntok = {}, {}, {}
            runner = eng.worker.runner if in_process else None
            decode_steps, expert_ids = [], []
            max_running, num_steps, full_steps = (0 if runner else None), 0, 0
            step_times, slowest = {}, []
            while eng.has_unfinished_requests():
                graph_before, t_step = runner.num_graph_steps if runner else 0, time.perf_counter()
                running_before = eng.core.scheduler.num_running if eng.core is not None else 0
                prefilling = _num_prefilling(eng)
                eager_before = runner.num_eager_steps if runner else 0
                full = runner is not None and eng.core.scheduler.num_running == bs
                if runner is not None:
                    max_running = max(max_running, eng.core.scheduler.num_running)
                    num_steps += 1
                    full_steps += full
                arm_before = _step_arm_counts(eng)
                changed = eng.step()
                now = time.perf_counter()
                if arm_before is not None:
                    key = _add_step_time(step_times, running_before, arm_before, _step_arm_counts(eng),
                                         now - t_step)
                    slowest.append((now - t_step, key, prefilling,
                                    runner.num_graph_steps - graph_before if runner else None,
                                    runner.num_eager_steps - eager_before if runner else None))
                if full and runner.num_graph_steps > graph_before:
                    decode_steps.append(now - t_step)
                    if len(decode_steps) % 8 == 1:   # async copies; counted after the run
                        expert_ids.append(_expert_ids(llm, recorder))
                for st in changed:
                    n = len(st.sequences[0].token_ids)
                    if n and st.request_id not in first:
                        first[st.request_id] = now
                    if st.finished:
                        last[st.request_id], ntok[st.request_id] = now, n
            total = time.perf_counter() - started
            tpot = sum((last[r] - first[r]) / (ntok[r] - 1) for r in last) / len(last)
            tpot_peer = (total - prefill) / args.osl
            seen = [[_count(ids, cfg) for ids in step] for step in expert_ids] or [
                [_count(ids, cfg) for ids in _expert_ids(llm, recorder)]]
            # without a measured count (engine processes) the roofline assumes the balanced-routing
            # expectation of distinct experts per layer for bs tokens x top-k
            experts = [sum(col) / len(col) for col in zip(*seen)] or _expected_experts(cfg, bs)
            decode_steps.sort()
            floor = decode_floor_ms(decode_step_bytes(cfg, bs, isl + args.osl // 2, experts,
                                                      weight_bytes=wbytes, kv_bytes=kvbytes,
                                                      expert_bytes=ebytes))
            if llm.engine.config.speculative.enabled:
                floor = None     # a verify + draft step is not the decode step this roofline counts
            flops = prefill_flops(cfg, bs, isl)
            compiled = new_variants(jit_before)
            problem = as_asked(bs, max_running, full_steps, num_steps)
            if problem:
                print(f"WARNING: point {isl}:{bs} did not run as asked: {problem}; its TPOT is not "
                      f"batch {bs}'s and no MBU is given", file=sys.stderr, flush=True)
                floor = None
            row = {"isl": isl, "bs": bs, "prefill_s": round(prefill, 3),
                   "prefill_tflops": round(flops / prefill / 1e12, 1),
                   "prefill_mfu": round(flops / prefill / 1e12 / peak, 3),
                   "tpot_peer_ms": round(tpot_peer * 1e3, 3), "tpot_ms": round(tpot * 1e3, 3),
                   "decode_tok_s": round(bs / tpot_peer, 1), "roofline_ms": round(floor, 3) if floor else None,
                   "mbu_peer_tpot": round(floor / (tpot_peer * 1e3), 3) if floor else None,
                   "distinct_experts": [round(e, 1) for e in experts],
                   "full_decode_step_ms_p50": round(decode_steps[len(decode_steps) // 2] * 1e3, 3) if decode_steps else None,
                   "full_decode_step_ms_mean_max": [round(sum(decode_steps) / len(decode_steps) * 1e3, 3),
                                                    round(decode_steps[-1] * 1e3, 3)] if decode_steps else None,
                   "jit_compiles_measured": sum(compiled.values()), "jit_kernels_measured": compiled,
                   "graph_steps": runner.num_graph_steps if runner else None,
                   "graph_kernels": _graph_kernels(runner, bs),
                   "eager_steps": runner.num_eager_steps if runner else None,
                   "experts_measured": bool(expert_ids) or in_process,
                   "ran_as_asked": problem is None, **({"not_as_asked": problem} if problem else {}),
                   "max_running": max_running,
                   **_spec_figures(llm, spec_before),
                   **({"step_ms_by_running_arm": _step_time_summary(step_times),
                       "slowest_steps": _slowest(slowest)} if step_times else {})}
            results.append(row)
            print(json.dumps(row), flush=True)
    return results
