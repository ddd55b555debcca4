"""Decode-step roofline for MiniMax-M3 (docs/benchmarks.md): bytes a step must read / HBM bandwidth.

Bytes = weights touched (attention, indexer, dense MLP, shared experts, router, the DISTINCT
routed experts the batch selects — measured, not assumed — and lm_head) + KV read (dense layers:
whole context; sparse layers: at most top-k x block tokens of K/V per KV head plus the full
index-key scan, which with cross-layer top-k reuse only the layers running the indexer do).
"""
from __future__ import annotations

from m3serve.kernels.ref.packed import MX_BLOCK, NVFP4_BLOCK

HBM_READ_TBPS = 4.19          # measured on one H200 (docs/benchmarks.md)
BF16_TFLOPS = 795.0           # dense bf16 GEMM ceiling on one H200 (docs/benchmarks.md)
FP8_TFLOPS = 1465.0
# bytes per weight element of the packed formats, block scales included (NVFP4's fp32 global
# scale per row is left out: 4 bytes per thousands of elements)
PACKED_BYTES = {"mxfp8": 1 + 1 / MX_BLOCK, "mxfp4": 0.5 + 1 / MX_BLOCK, "nvfp4": 0.5 + 1 / NVFP4_BLOCK}


def _weights_per_layer(cfg) -> dict[str, int]:
    """Weight elements of each block kind: attention q/o/k/v, the indexer's q/k projections, one
    routed expert, the shared expert, the dense MLP."""
    H, D = cfg.hidden_size, cfg.head_dim
    return {"attn": H * D * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2),
            "index": H * cfg.index_head_dim * (cfg.index_n_heads + 1),
            "expert": 3 * H * cfg.intermediate_size,
            "shared": 3 * H * cfg.shared_intermediate_size,
            "dense": 3 * H * cfg.dense_intermediate_size}


def decode_step_bytes(cfg, batch: int, context_len: int, distinct_experts: list[float],
                      weight_bytes: float = 2.0, kv_bytes: float = 2.0,
                      lm_head_bytes: float = 2.0, expert_bytes: float | None = None) -> float:
    """distinct_experts: per MoE layer, the number of distinct routed experts the step touched.
    weight_bytes applies to the quantisable linear layers and expert_bytes (default: the same)
    to the routed and shared experts, packed codes plus their scales (`PACKED_BYTES`); lm_head
    stays bf16 under `--quantization fp8` (the default exclusions), the router fp32."""
    expert_bytes = weight_bytes if expert_bytes is None else expert_bytes
    H, D = cfg.hidden_size, cfg.head_dim
    w = _weights_per_layer(cfg)
    total = cfg.vocab_size * H * lm_head_bytes                                     # lm_head
    moe_i = 0
    kv_token = 2 * cfg.num_key_value_heads * D * kv_bytes
    sparse_tokens = min(context_len, cfg.index_topk_blocks * cfg.index_block_size)
    for i in range(cfg.num_hidden_layers):
        total += w["attn"] * weight_bytes
        if cfg.is_sparse(i):
            total += batch * sparse_tokens * kv_token
            if cfg.computes_index(i):       # a layer reusing another's selection scans nothing
                total += w["index"] * weight_bytes + batch * context_len * cfg.index_head_dim * kv_bytes
        else:
            total += batch * context_len * kv_token
        if cfg.is_moe(i):
            total += (distinct_experts[moe_i] * w["expert"] + w["shared"]) * expert_bytes
            total += cfg.num_local_experts * H * 4                                # fp32 router
            moe_i += 1
        else:
            total += w["dense"] * weight_bytes
    return total


def decode_floor_ms(bytes_: float, tbps: float = HBM_READ_TBPS) -> float:
    return bytes_ / (tbps * 1e12) * 1e3


def prefill_flops(cfg, batch: int, prompt_len: int) -> float:
    """FLOPs of prefilling `batch` prompts of `prompt_len` tokens (the MFU numerator): 2 x active
    weights per token (top-k routed + shared experts, router, indexer projections), causal
    attention counted once per (query, key) pair it computes (dense layers: all earlier keys;
    sparse layers: at most top-k x block keys, plus the indexer's scan of all earlier index keys),
    and lm_head for the last position of each prompt only. A model that is one rank's view of
    expert parallelism (`cfg.expert_view`) counts the routed rows it receives under balanced
    routing: top-k / size per token."""
    H, D = cfg.hidden_size, cfg.head_dim
    w = _weights_per_layer(cfg)
    held = 1 / cfg.expert_view[1] if cfg.expert_view else 1.0   # an expert view computes its share
    moe_w = held * cfg.num_experts_per_tok * w["expert"] + w["shared"] + cfg.num_local_experts * H
    S = prompt_len
    causal_pairs = S * (S + 1) / 2                       # sum over positions p of (p + 1)
    cap = cfg.index_topk_blocks * cfg.index_block_size
    sparse_pairs = (causal_pairs if S <= cap
                    else cap * (cap + 1) / 2 + (S - cap) * cap)
    per_pair_attn = 4 * cfg.num_attention_heads * D      # QK^T and PV, 2 FLOPs per MAC
    per_pair_index = 2 * cfg.index_n_heads * cfg.index_head_dim
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        active = w["attn"] + (moe_w if cfg.is_moe(i) else w["dense"])
        if cfg.is_sparse(i):
            total += per_pair_attn * sparse_pairs
        if cfg.computes_index(i):
            active += w["index"]
            total += per_pair_index * causal_pairs
        else:
            total += per_pair_attn * causal_pairs
        total += 2 * active * S
    return batch * (total + 2 * cfg.vocab_size * H)
