"""Tensor-parallel group state: this process's rank and world size, and the all-reduce.

Single-process runs (and tests that build shards in one process) use `TPInfo(rank, size)`
without an initialised process group; collectives then run only when a group exists.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank/size {self.rank}/{self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the TP group in place (no-op when TP = 1 or no group is initialised)."""
        if self.size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(x)
        return x
