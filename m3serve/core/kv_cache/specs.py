"""The two KV cache groups of MiniMax-M3 and how many blocks fit in a memory budget.

Group "main" holds K and V for every attention layer; group "index" holds the key-only index
cache of every sparse layer that runs the indexer (all of them unless cross-layer top-k reuse is
on: `M3Config.index_layer_ids`). Both share the page size and the block ids (block b is page b of
every group's tensors), so one block costs the sum of both groups' bytes. A sliding-window
draft (DSpark) has a pool of its own, a window per running request (`window_pool_blocks`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheGroupSpec:
    name: str
    layer_ids: tuple[int, ...]
    bytes_per_token_per_layer: int

    def bytes_per_block(self, block_size: int) -> int:
        return len(self.layer_ids) * self.bytes_per_token_per_layer * block_size


def cache_group_specs(cfg, num_kv_heads_local: int, kv_dtype_bytes: int,
                      index_dtype_bytes: int) -> list[CacheGroupSpec]:
    """Main K/V for all layers (2 x kv heads x head_dim), index keys for the indexer layers."""
    main = CacheGroupSpec("main", tuple(range(cfg.num_hidden_layers)),
                          2 * num_kv_heads_local * cfg.head_dim * kv_dtype_bytes)
    index = CacheGroupSpec("index", tuple(cfg.index_layer_ids), cfg.index_head_dim * index_dtype_bytes)
    return [main, index]


def num_blocks_for_memory(specs: list[CacheGroupSpec], block_size: int, memory_bytes: int) -> int:
    """Pages of every group that fit in `memory_bytes` (block 0 is the reserved null block)."""
    per_block = sum(s.bytes_per_block(block_size) for s in specs)
    return memory_bytes // per_block


def window_blocks_per_request(window: int, num_lookahead: int, block_size: int) -> int:
    """Most blocks a request holds in a window draft's pool (`draft_window.py`): the tokens
    [lo, c' + k) it keeps are W + 2k - 1, at any offset in a block."""
    num_tokens = window + 2 * num_lookahead - 1
    return (num_tokens + block_size - 2) // block_size + 1


def window_pool_blocks(window: int, num_lookahead: int, block_size: int, max_num_seqs: int,
                       max_model_len: int) -> int:
    """Blocks of the draft's pool (block 0, the null block, included): every running request's
    window, never more than a whole context's blocks each."""
    context = -(-(max_model_len + num_lookahead) // block_size)
    return max_num_seqs * min(window_blocks_per_request(window, num_lookahead, block_size), context) + 1
