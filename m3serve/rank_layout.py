"""Where each global rank sits: its TP and DP ranks, its host and its GPU there. Plain
arithmetic over the parallel sizes, without torch, for the engine's processes and the process
groups alike."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    """Where global rank `rank` sits among tp x dp ranks spread over `nnodes` hosts: rank
    r = dp_rank * tp + tp_rank, so a TP group (one DP replica) is tp consecutive ranks and a DP
    group is the ranks sharing a TP rank across replicas; node n hosts ranks
    [n * per_node, (n + 1) * per_node), each on the GPU numbered by its local rank."""
    tp: int
    dp: int
    nnodes: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def per_node(self) -> int:
        return self.world_size // self.nnodes

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.per_node

    def leader_of(self, rank: int) -> int:
        """The TP-rank-0 process of `rank`'s DP replica: it runs that replica's engine core."""
        return rank - rank % self.tp

    def tp_group_ranks(self, dp_rank: int) -> list[int]:
        return list(range(dp_rank * self.tp, (dp_rank + 1) * self.tp))

    def dp_group_ranks(self, tp_rank: int) -> list[int]:
        return [d * self.tp + tp_rank for d in range(self.dp)]

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    @classmethod
    def of(cls, parallel) -> "RankLayout":
        """The layout of a `config.ParallelConfig`."""
        return cls(parallel.tensor_parallel_size, parallel.data_parallel_size, parallel.nnodes)
