"""Decode-step roofline for MiniMax-M3 (BENCHMARKS.md): bytes a step must read / HBM bandwidth.

Bytes = weights touched (attention, indexer, dense MLP, shared experts, router, the DISTINCT
routed experts the batch selects — measured, not assumed — and lm_head) + KV read (dense layers:
whole context; sparse layers: at most top-k x block tokens of K/V per KV head plus the full
index-key scan).
"""
from __future__ import annotations

HBM_READ_TBPS = 4.19          # measured on one H200 (BENCHMARKS.md)


def decode_step_bytes(cfg, batch: int, context_len: int, distinct_experts: list[float],
                      weight_bytes: float = 2.0, kv_bytes: float = 2.0) -> float:
    """distinct_experts: per MoE layer, the number of distinct routed experts the step touched."""
    H, D = cfg.hidden_size, cfg.head_dim
    attn = H * D * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)   # q, o, k, v
    index = H * cfg.index_head_dim * (cfg.index_n_heads + 1)
    expert = 3 * H * cfg.intermediate_size
    shared = 3 * H * cfg.shared_intermediate_size
    dense = 3 * H * cfg.dense_intermediate_size
    total = cfg.vocab_size * H * weight_bytes                                      # lm_head
    moe_i = 0
    kv_token = 2 * cfg.num_key_value_heads * D * kv_bytes
    sparse_tokens = min(context_len, cfg.index_topk_blocks * cfg.index_block_size)
    for i in range(cfg.num_hidden_layers):
        total += attn * weight_bytes
        if cfg.is_sparse(i):
            total += index * weight_bytes
            total += batch * (sparse_tokens * kv_token + context_len * cfg.index_head_dim * kv_bytes)
        else:
            total += batch * context_len * kv_token
        if cfg.is_moe(i):
            total += (distinct_experts[moe_i] * expert + shared) * weight_bytes
            total += cfg.num_local_experts * H * 4                                # fp32 router
            moe_i += 1
        else:
            total += dense * weight_bytes
    return total


def decode_floor_ms(bytes_: float, tbps: float = HBM_READ_TBPS) -> float:
    return bytes_ / (tbps * 1e12) * 1e3
