"""The two KV cache groups of MiniMax-M3 and how many blocks fit in a memory budget.

Group "main" holds K and V for every attention layer; group "index" holds the key-only index
cache of every sparse layer. Both share the page size and the block ids (block b is page b of
every group's tensors), so one block costs the sum of both groups' bytes.
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
    """Main K/V for all layers (2 x kv heads x head_dim), index keys for sparse layers."""
    main = CacheGroupSpec("main", tuple(range(cfg.num_hidden_layers)),
                          2 * num_kv_heads_local * cfg.head_dim * kv_dtype_bytes)
    index = CacheGroupSpec("index", tuple(cfg.sparse_layer_ids), cfg.index_head_dim * index_dtype_bytes)
    return [main, index]


def num_blocks_for_memory(specs: list[CacheGroupSpec], block_size: int, memory_bytes: int) -> int:
    """Pages of every group that fit in `memory_bytes` (block 0 is the reserved null block)."""
    per_block = sum(s.bytes_per_block(block_size) for s in specs)
    return memory_bytes // per_block
