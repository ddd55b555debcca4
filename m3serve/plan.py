"""Deployment arithmetic without loading weights (and without torch): whether a parallel layout
fits the model's shapes (`check_layout`, run before any process starts), and `m3serve plan`:
weight bytes per GPU, KV-cache bytes per token per GPU (replicated KV heads counted), and how
many tokens and concurrent requests fit. A sliding-window draft (DSpark) costs no KV bytes per
context token: its own pool holds a window per running request (`--max-num-seqs` of them),
taken from the budget before the target's blocks.

The counts follow the engine's own sharding (layers/linear.py, layers/moe.py,
model/minimax_m3.py): q heads, o, gate/up/down split over TP; KV and index-query heads split,
or replicated once TP exceeds their count; the index-key head, norms and router replicated;
embedding and lm_head split by vocabulary rows (ceil(V / TP) per rank); routed experts split
over all DP x TP ranks (whole experts with expert parallelism, else each expert's
intermediate channels). A quantised checkpoint's linears count in their stored formats (read
from its quantization_config, `model/formats`): codes plus block scales (MXFP8 1 + 1/32 bytes
per element, MXFP4 1/2 + 1/32, NVFP4 1/2 + 1/16 and an fp32 global scale per row).
`--quantization fp8` stores every linear weight in one byte plus an fp32 scale per output row;
`--quantization mxfp4 | nvfp4` the routed and shared experts in 4 bits; embedding, lm_head,
norms and the fp32 router stay as they are.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from m3serve.config import CACHE_DTYPES, QUANTIZATION_METHODS, ParallelConfig
from m3serve.model.config import M3Config

GIB = 1 << 30
H200_MEMORY_GIB = 143771 / 1024       # what an H200 reports (143,771 MiB)
ACTIVATION_HEADROOM = 2 << 30         # what the worker keeps free beside the KV cache


def _kv_heads_per_rank(heads: int, tp: int) -> int:
    return heads // tp if tp <= heads else 1


def check_layout(cfg: M3Config, parallel: ParallelConfig, format_of=None, quantization: str | None = None) -> None:
    """ValueError naming the numbers when the layout cannot shard this model, or would cut a
    scale block of its quantised weights in two (`format_of`: the checkpoint's format of a
    canonical module, `plan`'s argument; `quantization`: the online one)."""
    tp, moe = parallel.tensor_parallel_size, parallel.world_size
    problems = []
    if cfg.num_attention_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_attention_heads} is not divisible by "
                        f"tensor_parallel_size={tp}")
    for name, heads in (("num_key_value_heads", cfg.num_key_value_heads),
                        ("index_n_heads", cfg.index_n_heads)):
        if heads and (heads % tp if tp <= heads else tp % heads):
            problems.append(f"{name}={heads} and tensor_parallel_size={tp}: one must divide the other")
    for name, size in (("dense_intermediate_size", cfg.dense_intermediate_size),
                       ("shared_intermediate_size", cfg.shared_intermediate_size)):
        if size % tp:
            problems.append(f"{name}={size} is not divisible by tensor_parallel_size={tp}")
    if parallel.enable_expert_parallel:
        if cfg.num_local_experts % moe:
            problems.append(
                f"expert parallelism over {moe} ranks (tensor x data parallel) needs "
                f"num_local_experts={cfg.num_local_experts} divisible by {moe}"
                + (f": only {cfg.num_local_experts} experts for {moe} ranks"
                   if cfg.num_local_experts < moe else ""))
    elif cfg.intermediate_size % moe:
        problems.append(f"the MoE layers are split over {moe} ranks (tensor x data parallel), but "
                        f"intermediate_size={cfg.intermediate_size} is not divisible by {moe}; "
                        f"use --enable-expert-parallel or another layout")
    problems += _block_problems(cfg, parallel, format_of, quantization)
    if problems:
        raise ValueError("impossible parallel layout: " + "; ".join(problems))


def _block_problems(cfg: M3Config, parallel: ParallelConfig, format_of, quantization) -> list[str]:
    """Each split reduction width (row-parallel inputs, the routed experts' w2 without expert
    parallelism) whose per-rank share is not a whole number of its format's scale blocks."""
    if format_of is None and quantization not in (*ONLINE_4BIT, "mxfp8"):
        return []
    tp, moe = parallel.tensor_parallel_size, parallel.world_size
    problems = []
    for i in range(cfg.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"model.layers.{i}.block_sparse_moe."
        cases = [("o_proj input (heads x head_dim)", p + "self_attn.o_proj", cfg.num_attention_heads * cfg.head_dim, tp)]
        if cfg.is_moe(i):
            cases.append(("shared_intermediate_size", m + "shared_experts.down_proj", cfg.shared_intermediate_size, tp))
            if not parallel.enable_expert_parallel:
                cases.append(("intermediate_size (routed experts)", m + "experts.0.w2", cfg.intermediate_size, moe))
        else:
            cases.append(("dense_intermediate_size", p + "mlp.down_proj", cfg.dense_intermediate_size, tp))
        for what, module, k, n in cases:
            fmt = _weight_format(module, format_of, quantization)
            block = WEIGHT_FORMATS[fmt][1] if fmt is not None else 0
            if block and n > 1 and (k // n) % block:
                msg = (f"{what}={k} split over {n} ranks is {k // n} per rank, not a multiple of "
                       f"the {fmt} scale block {block}")
                if msg not in problems:
                    problems.append(msg)
    return problems


def check_checkpoint_layout(model_dir, model, parallel: ParallelConfig) -> M3Config:
    """`check_layout` for a checkpoint directory and the engine's ModelConfig `model`: its
    shapes, and the scale blocks of its stored (or online) quantisation. Returns its config."""
    from m3serve.model.config import load_config, read_config_json
    from m3serve.model.formats import detect_scheme
    cfg = load_config(model_dir, model.hf_overrides)
    check_layout(cfg, parallel, _scheme_formats(detect_scheme(read_config_json(model_dir))),
                 model.quantization)
    return cfg


def _scheme_formats(scheme):
    """format_of(canonical module) -> "mxfp8" | "mxfp4" | "nvfp4" | None for a detected
    quantisation scheme (None for none)."""
    from m3serve.model.formats import LAYOUT_FORMATS
    if scheme is None:
        return None

    def format_of(module: str):
        name = scheme.layout_of(module)
        return None if name is None else LAYOUT_FORMATS[name]
    return format_of


def _weight_format(module: str, format_of, quantization) -> str | None:
    """The format a linear's weight is held in: online 4-bit experts override the stored one."""
    if quantization in ONLINE_4BIT and (".experts." in module or ".shared_experts." in module):
        return quantization
    if quantization == "mxfp8" and module:      # every linear layer (lm_head is not one here)
        return quantization
    return format_of(module) if format_of is not None and module else None


@dataclass
class Plan:
    weight_bytes: dict[str, int]     # per GPU, by part
    kv_bytes_per_token: dict[str, int]   # per GPU: "main", "index" (and a block-sharing draft's)
    kv_heads_per_rank: int
    draft_window: dict | None = None     # a window draft's pool: bytes_per_token, sliding_window, k

    @property
    def total_weight_bytes(self) -> int:
        return sum(self.weight_bytes.values())

    @property
    def total_kv_bytes_per_token(self) -> int:
        return sum(self.kv_bytes_per_token.values())


# weight format -> (elements per code byte, elements per block scale byte, fp32 bytes per row)
WEIGHT_FORMATS = {"fp8": (1, 0, 4), "mxfp8": (1, 32, 0), "mxfp4": (2, 32, 0), "nvfp4": (2, 16, 4)}
ONLINE_4BIT = ("mxfp4", "nvfp4")


def plan(cfg: M3Config, parallel: ParallelConfig, quantization: str | None = None,
         kv_cache_dtype: str = "auto", index_cache_dtype: str = "auto", dtype_bytes: int = 2,
         draft: dict | None = None, format_of=None) -> Plan:
    """Bytes of one rank (every rank holds the same amount). `draft` (see `draft_kv`) adds the
    speculative draft's cache group(s) to the KV bytes per token (EAGLE3, MTP) or describes its
    window pool (DSpark, `Plan.draft_window`; `capacity` sizes it). `format_of(canonical module)`:
    the stored checkpoint's format of a linear ("mxfp8" | "mxfp4" | "nvfp4" | None = dtype);
    online `quantization` overrides it where it applies."""
    check_layout(cfg, parallel)
    tp, moe = parallel.tensor_parallel_size, parallel.world_size
    H, D, Di = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    fp8 = quantization in ("fp8", "fp8_per_channel")

    def linear(rows: int, cols: int, module: str = "") -> int:   # one linear weight [rows, cols] of this rank
        fmt = "fp8" if fp8 else _weight_format(module, format_of, quantization)
        if fmt is None:
            return rows * cols * dtype_bytes
        per_byte, block, row_bytes = WEIGHT_FORMATS[fmt]
        return rows * cols // per_byte + (rows * (cols // block) if block else 0) + row_bytes * rows

    kv_local = _kv_heads_per_rank(cfg.num_key_value_heads, tp)
    idx_local = _kv_heads_per_rank(cfg.index_n_heads, tp)
    q_local = cfg.num_attention_heads // tp
    vocab_rows = -(-cfg.vocab_size // tp)
    if parallel.enable_expert_parallel:
        experts, inter = cfg.num_local_experts // moe, cfg.intermediate_size
    else:
        experts, inter = cfg.num_local_experts, cfg.intermediate_size // moe
    parts = {"embed_tokens": vocab_rows * H * dtype_bytes, "lm_head": vocab_rows * H * dtype_bytes,
             "attention": 0, "indexer": 0, "dense_mlp": 0, "routed_experts": 0,
             "shared_expert": 0, "router": 0, "norms": H * dtype_bytes}
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.block_sparse_moe."
        parts["norms"] += (2 * H + 2 * D) * dtype_bytes
        parts["attention"] += linear((q_local + 2 * kv_local) * D, H, a + "q_proj") + linear(H, q_local * D, a + "o_proj")
        if cfg.computes_index(i):
            # index_q and index_k live in the fused qkv weight: one scale per row as well
            # (a sparse layer reusing another's selection has neither, nor their norms)
            parts["indexer"] += linear((idx_local + 1) * Di, H, a + "q_proj")
            parts["norms"] += 2 * Di * dtype_bytes
        if cfg.is_moe(i):
            E = cfg.num_local_experts
            parts["router"] += (E * H + E) * 4
            parts["routed_experts"] += experts * (linear(2 * inter, H, m + "experts.0.w1")
                                                  + linear(H, inter, m + "experts.0.w2"))
            s = cfg.shared_intermediate_size // tp
            parts["shared_expert"] += linear(2 * s, H, m + "shared_experts.gate_proj") \
                + linear(H, s, m + "shared_experts.down_proj")
        else:
            d, mlp = cfg.dense_intermediate_size // tp, f"model.layers.{i}.mlp."
            parts["dense_mlp"] += linear(2 * d, H, mlp + "gate_proj") + linear(H, d, mlp + "down_proj")
    kv_b = 1 if kv_cache_dtype != "auto" else dtype_bytes
    idx_b = 1 if index_cache_dtype != "auto" else dtype_bytes
    kv = {"main": cfg.num_hidden_layers * 2 * kv_local * D * kv_b,
          "index": len(cfg.index_layer_ids) * Di * idx_b}
    window = None
    if draft is not None:
        if draft["method"] == "eagle3":               # never fp8, like DSpark's below
            heads = _kv_heads_per_rank(draft["num_key_value_heads"], draft["tensor_parallel_size"])
            kv["draft"] = 2 * heads * draft["head_dim"] * dtype_bytes
        elif draft["method"] == "dspark":            # never fp8: the draft's K/V keep the model dtype
            heads = _kv_heads_per_rank(draft["num_key_value_heads"], draft["tensor_parallel_size"])
            window = {"bytes_per_token": draft["layers"] * 2 * heads * draft["head_dim"] * dtype_bytes,
                      "sliding_window": draft["sliding_window"],
                      "num_speculative_tokens": draft["num_speculative_tokens"]}
        else:
            kv["draft"] = draft["modules"] * (2 * kv_local * D * kv_b + Di * idx_b)
    return Plan(parts, kv, kv_local, window)


def draft_kv(spec_json: str, cfg: M3Config, parallel: ParallelConfig, model: str | None = None) -> dict:
    """What the planner needs of a `--speculative-config`: the EAGLE3 or DSpark draft's KV heads
    and head size (from its config.json; DSpark's in `model`'s dspark/ folder unless named) with
    the ranks its layers are split over and their number, or MTP's module count."""
    import json

    from m3serve.config import SpeculativeConfig
    from m3serve.model.draft_files import dspark_config_path, eagle3_draft_dir, read_dspark_config

    spec = SpeculativeConfig(spec_json)
    if spec.method == "dspark":
        _, text = read_dspark_config(dspark_config_path(spec.model, model))
        heads = text.get("num_attention_heads", 1)
        return {"method": "dspark", "layers": text.get("num_hidden_layers", 1),
                "sliding_window": text.get("sliding_window", 4096),
                "num_speculative_tokens": spec.num_speculative_tokens or text.get("dspark_block_size", 1),
                "num_key_value_heads": text.get("num_key_value_heads", heads),
                "head_dim": text.get("head_dim") or text.get("hidden_size", heads) // heads,
                "tensor_parallel_size": spec.draft_tensor_parallel_size or parallel.tensor_parallel_size}
    if spec.method == "eagle3":
        raw = json.loads((eagle3_draft_dir(spec.model, model, config_only=True) / "config.json").read_text())
        heads = raw["num_attention_heads"]
        draft_tp = spec.draft_tensor_parallel_size or parallel.tensor_parallel_size
        return {"method": "eagle3", "num_key_value_heads": raw.get("num_key_value_heads", heads),
                "head_dim": raw.get("head_dim") or raw["hidden_size"] // heads,
                "tensor_parallel_size": draft_tp}
    return {"method": "mtp", "modules": spec.num_speculative_tokens}


def draft_window_bytes(p: Plan, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """A window draft's pool on each GPU (`core/kv_cache/draft_window.py`): a window of blocks
    per running request, whatever the context length (0 without one)."""
    from m3serve.core.kv_cache.specs import window_pool_blocks
    w = p.draft_window
    if w is None:
        return 0
    blocks = window_pool_blocks(w["sliding_window"], w["num_speculative_tokens"], block_size, max_num_seqs,
                                max_model_len)
    return blocks * block_size * w["bytes_per_token"]


def capacity(p: Plan, cfg: M3Config, gpu_memory_bytes: int, gpu_memory_utilization: float,
             max_model_len: int, block_size: int, max_num_seqs: int = 256) -> dict:
    """How many KV tokens fit on each GPU (every rank of a replica holds the same tokens), and
    how many requests of max_model_len tokens that is per DP replica; a window draft's pool
    for `max_num_seqs` running requests comes first."""
    draft_bytes = draft_window_bytes(p, block_size, max_num_seqs, max_model_len)
    budget = (int(gpu_memory_bytes * gpu_memory_utilization) - p.total_weight_bytes - ACTIVATION_HEADROOM
              - draft_bytes)
    per_block = p.total_kv_bytes_per_token * block_size
    blocks = max(0, budget // per_block - 1) if budget > 0 else 0       # block 0 is the null block
    tokens = blocks * block_size
    blocks_per_request = -(-max_model_len // block_size)
    return {"kv_budget_bytes": max(0, budget), "kv_blocks": blocks, "kv_tokens": tokens,
            "draft_window_bytes": draft_bytes,
            "max_model_len": max_model_len,
            "concurrent_requests": blocks // blocks_per_request if blocks_per_request else 0,
            "fits": budget > 0 and blocks >= blocks_per_request}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="checkpoint directory or hub id (only config.json is read; the configs of "
                                      "MiniMaxAI/MiniMax-M3, MiniMax-M3-MXFP8 and MiniMax-M3.1-Flash ship with "
                                      "m3serve, so those ids need no network)")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("-dp", "--data-parallel-size", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                        help="online quantisation of a BF16 checkpoint (mxfp4 / nvfp4: the experts)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=CACHE_DTYPES)
    parser.add_argument("--index-cache-dtype", default="auto", choices=CACHE_DTYPES)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="request length for the concurrency figure (default: the model's maximum)")
    parser.add_argument("--gpu-memory-gib", type=float, default=H200_MEMORY_GIB,
                        help=f"memory of one GPU (default: an H200's, {H200_MEMORY_GIB:.1f} GiB)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="running requests, each with a window of a DSpark draft's KV (default 256)")
    parser.add_argument("--speculative-config", default=None,
                        help="count the draft's KV cache too (the --speculative-config JSON)")
    parser.add_argument("--hf-overrides", default=None,
                        help="JSON laid over config.json as the engine lays it (e.g. cross-layer top-k "
                             "reuse: '{\"text_config\": {\"use_index_cache\": true, \"index_topk_freq\": 4}}', "
                             "which drops the index cache and projections of the layers that skip the indexer)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _read_config(model: str) -> tuple[dict, str]:
    """(config.json dict, where it came from): a local directory's
    file; a known hub id's copy shipped with m3serve (no network); else the hub's file."""
    from pathlib import Path

    from m3serve.model.config import read_config_json
    from m3serve.model.files import resolve_model_dir
    from m3serve.model.known_configs import known_config

    known = None if Path(model).is_dir() else known_config(model)
    if known is not None:
        raw = known.load()
        source = f"m3serve's shipped copy of {known.repo_id}'s config.json, offline: {known.label}"
    else:
        directory = resolve_model_dir(model, config_only=True)
        raw, source = read_config_json(directory), f"{Path(directory) / 'config.json'}"
    return raw, source


def stored_formats(raw: dict):
    """(format_of(canonical module) for `plan`, a note): the checkpoint's own formats from its
    quantization_config; one that m3serve cannot read counts as BF16, and the note says so."""
    from m3serve.model.formats import detect_scheme
    try:
        scheme = detect_scheme(raw)
    except ValueError as e:
        return None, f"the checkpoint's quantization_config is not modelled ({e}): weights count as BF16"
    if scheme is None:
        return None, None
    return _scheme_formats(scheme), f"weights counted in the checkpoint's own formats: {scheme.summary}"


def format_table(cfg: M3Config, parallel: ParallelConfig, args, stored, draft) -> list[dict]:
    """Weights per GPU and KV tokens per replica for each way to hold the weights: as stored,
    and the BF16 release quantised online (fp8; mxfp4 / nvfp4 experts)."""
    rows = [("as stored", None, stored)] if stored is not None else [("bf16", None, None)]
    rows += [("bf16 + online fp8", "fp8", None), ("bf16 + online mxfp8", "mxfp8", None),
             ("bf16 + online mxfp4 experts", "mxfp4", None),
             ("bf16 + online nvfp4 experts", "nvfp4", None)]
    out = []
    for label, quantization, format_of in rows:
        p = plan(cfg, parallel, quantization, args.kv_cache_dtype, args.index_cache_dtype, draft=draft,
                 format_of=format_of)
        fit = capacity(p, cfg, int(args.gpu_memory_gib * GIB), args.gpu_memory_utilization,
                       args.max_model_len or cfg.max_position_embeddings, cfg.index_block_size,
                       getattr(args, "max_num_seqs", 256))
        out.append({"weights": label, "weights_per_gpu_bytes": p.total_weight_bytes,
                    "kv_tokens": fit["kv_tokens"], "fits": fit["fits"]})
    return out


def main(args) -> dict:
    from m3serve.model.config import parse_config

    raw, source = _read_config(args.model)
    overrides = getattr(args, "hf_overrides", None)
    if overrides:
        from m3serve.config import _json_object_option
        from m3serve.model.config import apply_overrides
        raw = apply_overrides(raw, _json_object_option(overrides, "hf_overrides"))
    cfg = parse_config(raw)
    format_of, quant_note = stored_formats(raw)
    parallel = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                              data_parallel_size=args.data_parallel_size,
                              enable_expert_parallel=args.enable_expert_parallel)
    draft = draft_kv(args.speculative_config, cfg, parallel, args.model) if args.speculative_config else None
    p = plan(cfg, parallel, args.quantization, args.kv_cache_dtype, args.index_cache_dtype, draft=draft,
             format_of=format_of)
    max_len = args.max_model_len or cfg.max_position_embeddings
    fit = capacity(p, cfg, int(args.gpu_memory_gib * GIB), args.gpu_memory_utilization, max_len,
                   cfg.index_block_size, getattr(args, "max_num_seqs", 256))
    result = {"model": args.model, "tensor_parallel_size": parallel.tensor_parallel_size,
              "data_parallel_size": parallel.data_parallel_size,
              "enable_expert_parallel": parallel.enable_expert_parallel, "gpus": parallel.world_size,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "weights_per_gpu_bytes": p.total_weight_bytes, "weights_per_gpu": p.weight_bytes,
              "kv_heads_per_gpu": p.kv_heads_per_rank, "flavor": cfg.flavor,
              "index_cache_layers": len(cfg.index_layer_ids),
              "index_topk_freq": cfg.index_topk_freq,
              "kv_bytes_per_token_per_gpu": p.total_kv_bytes_per_token,
              "kv_bytes_per_token_per_gpu_by_cache": p.kv_bytes_per_token,
              "gpu_memory_gib": args.gpu_memory_gib, "gpu_memory_utilization": args.gpu_memory_utilization,
              "config_source": source, "quantization_note": quant_note,
              "max_num_seqs": getattr(args, "max_num_seqs", 256),
              "by_weight_format": format_table(cfg, parallel, args, format_of, draft), **fit}
    if args.json:
        print(json.dumps(result))
    else:
        print(_render(result, cfg))
    return result


def _render(r: dict, cfg: M3Config) -> str:
    ep = ", expert parallel" if r["enable_expert_parallel"] else ""
    lines = [f"{r['model']}: TP {r['tensor_parallel_size']} x DP {r['data_parallel_size']}{ep} "
             f"= {r['gpus']} GPUs, weights {r['quantization'] or 'as stored'}, KV {r['kv_cache_dtype']}",
             f"  config: {r['config_source']}"]
    if r["quantization_note"]:
        lines.append(f"  note: {r['quantization_note']}")
    lines += [f"  weights per GPU: {r['weights_per_gpu_bytes'] / GIB:.2f} GiB"]
    for part, n in r["weights_per_gpu"].items():
        if n:
            lines.append(f"    {part:<15} {n / GIB:8.3f} GiB")
    replicated = (" (KV heads replicated: "
                  f"{cfg.num_key_value_heads} heads over TP {r['tensor_parallel_size']})"
                  if r["tensor_parallel_size"] > cfg.num_key_value_heads else "")
    kv = r["kv_bytes_per_token_per_gpu_by_cache"]
    draft = f" + draft {kv['draft']:,}" if "draft" in kv else ""
    lines.append(f"  KV cache per token per GPU: {r['kv_bytes_per_token_per_gpu']:,} B "
                 f"(main {kv['main']:,} + index {kv['index']:,} in {r['index_cache_layers']} of "
                 f"{cfg.num_hidden_layers} layers{draft}){replicated}")
    if r["index_topk_freq"] > 1:
        lines.append(f"  cross-layer top-k reuse: index_topk_freq {r['index_topk_freq']}, offset "
                     f"{cfg.index_skip_topk_offset}: {r['index_cache_layers']} of {len(cfg.sparse_layer_ids)} "
                     f"sparse layers run the indexer (an approximation of the trained model)")
    if r["draft_window_bytes"]:
        lines.append(f"  draft KV (DSpark): its own window pool, {r['draft_window_bytes'] / GIB:.3f} GiB per GPU "
                     f"for {r['max_num_seqs']} running requests, nothing per context token")
    lines.append("  by weight format (weights per GPU, KV tokens per replica):")
    for row in r["by_weight_format"]:
        fits = "" if row["fits"] else "  (does not fit one request)"
        lines.append(f"    {row['weights']:<28} {row['weights_per_gpu_bytes'] / GIB:8.2f} GiB "
                     f"{row['kv_tokens']:>12,} tokens{fits}")
    if r["kv_budget_bytes"] <= 0:
        lines.append(f"  DOES NOT FIT: the weights alone exceed {r['gpu_memory_utilization']:.0%} of "
                     f"{r['gpu_memory_gib']:.1f} GiB per GPU (less 2 GiB for activations)")
        return "\n".join(lines)
    lines.append(f"  KV budget per GPU: {r['kv_budget_bytes'] / GIB:.2f} GiB -> {r['kv_tokens']:,} "
                 f"tokens of KV per replica (GPU memory {r['gpu_memory_gib']:.1f} GiB x "
                 f"{r['gpu_memory_utilization']}, less weights and 2 GiB for activations)")
    if r["fits"]:
        lines.append(f"  {r['concurrent_requests']} concurrent requests of {r['max_model_len']:,} "
                     f"tokens per replica, {r['concurrent_requests'] * r['data_parallel_size']} in all")
    else:
        lines.append(f"  DOES NOT FIT one request of {r['max_model_len']:,} tokens "
                     f"(set --max-model-len lower)")
    return "\n".join(lines)
