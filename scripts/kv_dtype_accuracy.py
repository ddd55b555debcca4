"""FP8 KV cache against bf16 KV on the same weights: the same token sequences teacher-forced
through the engine's own model runner (a prefill, then one-token decode steps that read the
cache), full-vocabulary logits compared per decode position: KL(bf16 || fp8), argmax agreement,
and the same figures for two bf16 runs (the run-to-run floor: the fused MoE reduces with fp32
atomics). Also prints each engine's KV capacity in tokens. GPU only.

    python scripts/kv_dtype_accuracy.py /tmp/rs4 [--isl 4096] [--steps 64] [--batch 4]
"""
from __future__ import annotations

import argparse
import gc
import json

import torch

from m3serve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams


def run(model: str, kv_dtype: str, index_dtype: str, sequences: list[list[int]], isl: int,
        repeats: int) -> tuple[list, dict]:
    llm = LLM(model=model, load_format="dummy", kv_cache_dtype=kv_dtype, index_cache_dtype=index_dtype,
              max_model_len=isl + 256,
              max_num_seqs=len(sequences), max_num_batched_tokens=isl * len(sequences), enforce_eager=True,
              enable_prefix_caching=False)
    runner = llm.engine.worker.runner
    taps = tuple(range(1, llm.engine.model_config.num_hidden_layers))  # the stream after each layer but the last
    bs = runner.block_size
    per_seq = -(-len(sequences[0]) // bs)
    info = {"kv_cache_dtype": kv_dtype, "index_cache_dtype": index_dtype, "num_blocks": runner.num_blocks, "kv_tokens": runner.num_blocks * bs}
    outs = []
    for rep in range(repeats):
        ids = [f"r{rep}s{i}" for i in range(len(sequences))]
        blocks = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(sequences))]
        new = [NewRequestData(rid, seq[:isl], SamplingParams(temperature=0), blk, 0)
               for rid, seq, blk in zip(ids, sequences, blocks)]
        so = SchedulerOutput(new, CachedRequestData.make_empty(), {rid: isl for rid in ids}, isl * len(ids),
                             {}, set(), set())
        runner.forward_hidden(so)
        logits, tapped = [], []
        for pos in range(isl, len(sequences[0])):
            cached = CachedRequestData.make_empty()
            for rid, seq in zip(ids, sequences):
                cached.req_ids.append(rid)
                cached.resumed_from_preemption.append(False)
                cached.new_token_ids.append([seq[pos]])
                cached.new_block_ids.append([])
                cached.num_computed_tokens.append(pos)
            so = SchedulerOutput([], cached, {rid: 1 for rid in ids}, len(ids), {}, set(), set())
            hidden, streams = runner.forward_hidden(so, taps)       # [B, H], [B, len(taps) * H]
            logits.append(runner.model.compute_logits(hidden).float().cpu())   # [B, V]
            tapped.append(torch.cat([streams, hidden], -1).view(len(ids), -1, hidden.shape[-1]).float().cpu())
        done = SchedulerOutput([], CachedRequestData.make_empty(), {}, 0, {}, set(ids), set())
        runner.execute_model(done)
        outs.append((torch.stack(logits, 1), torch.stack(tapped, 1)))   # [B, steps, V], [B, steps, L, H]
    llm.shutdown()
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return outs, info


def compare(x: tuple, y: tuple) -> dict:
    """Logits: KL and argmax agreement. Streams: relative L2 error of the residual stream after
    each layer (the last one: the final hidden states), mean over positions."""
    a, b = x[0], y[0]
    rel = ((x[1] - y[1]).norm(dim=-1) / x[1].norm(dim=-1)).mean(dim=(0, 1))      # [L]
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (la.exp() * (la - lb)).sum(-1)                               # [B, steps]
    agree = (a.argmax(-1) == b.argmax(-1)).float()
    return {"stream_rel_err_per_layer": [round(float(r), 5) for r in rel], "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "argmax_agreement": float(agree.mean()),
            "positions": int(agree.numel())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--isl", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    sequences = torch.randint(0, 2000, (args.batch, args.isl + args.steps), generator=g).tolist()
    (bf16_a, bf16_b), bf16_info = run(args.model, "auto", "auto", sequences, args.isl, 2)
    (fp8,), fp8_info = run(args.model, "fp8", "auto", sequences, args.isl, 1)
    (both,), both_info = run(args.model, "fp8", "fp8", sequences, args.isl, 1)
    print(json.dumps({"isl": args.isl, "steps": args.steps, "batch": args.batch,
                      "bf16_vs_bf16": compare(bf16_a, bf16_b), "bf16_vs_fp8_kv": compare(bf16_a, fp8),
                      "bf16_vs_fp8_kv_and_index": compare(bf16_a, both),
                      "capacity": [bf16_info, fp8_info, both_info]}, indent=1))


if __name__ == "__main__":
    main()
