"""Process groups and collectives: which rank this process is, in which groups, and the few
collectives the model uses (all-reduce, all-gather, reduce-scatter) on explicit groups.

Ranks are laid out as `RankLayout` says (TP groups of consecutive ranks). `ParallelInfo` is what the model layers get: the TP group, the DP group and whether experts are
partitioned (expert parallelism); the MoE layers span all DP x TP ranks.

Without an initialised group (single process, or tests that build every rank's shards in one
process) `GroupInfo(rank, size)` still shards weights; its collectives then do nothing.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from m3serve.rank_layout import RankLayout

# torch renamed the single-tensor collectives; the new names where they exist
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class GroupInfo:
    """This process's place in one group of ranks, and collectives over that group."""
    rank: int = 0
    size: int = 1
    group: object = field(default=None, compare=False, repr=False)  # a torch ProcessGroup
    # small-message all-reduce (kernels/allreduce.OneShotAllReduce) tried before `group`'s
    fast: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid group rank/size {self.rank}/{self.size}")

    @property
    def active(self) -> bool:
        return self.size > 1 and self.group is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place (no-op for one rank or no group): through the
        one-shot IPC kernel when this message fits it, else the group's backend (NCCL, gloo)."""
        if self.active:
            if self.fast is not None and self.fast.accepts(x):
                self.fast.launch(x)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] on every rank -> [size * N, ...], rank-major (no-op for one rank)."""
        if not self.active:
            return x
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[size * N, ...] -> this rank's [N, ...] slice of the sum over the group."""
        if not self.active:
            return x
        out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        _reduce_scatter(out, x.contiguous(), group=self.group)
        return out


# Kept for the single-process sharding tests and callers that only know TP.
TPInfo = GroupInfo


@dataclass(frozen=True)
class ParallelInfo:
    """What a model shard needs to know about parallelism."""
    tp: GroupInfo = GroupInfo()
    dp: GroupInfo = GroupInfo()       # ranks holding this TP rank in the other DP replicas
    enable_expert_parallel: bool = False

    @property
    def moe_rank(self) -> int:
        """Rank in the MoE group (all DP x TP ranks)."""
        return self.dp.rank * self.tp.size + self.tp.rank

    @property
    def moe_size(self) -> int:
        return self.dp.size * self.tp.size


@dataclass
class RankGroups:
    """Every group one rank belongs to, after `init_rank_groups`."""
    layout: RankLayout
    rank: int
    parallel: ParallelInfo
    tp_cpu: object        # gloo group over the TP group: the engine core's step broadcast
    dp_leaders_cpu: object | None  # gloo group of the DP replicas' leaders (lock-step sync)
    world_cpu: object     # gloo group over every rank (KV sizing, state reports)

    @property
    def is_leader(self) -> bool:
        return self.rank % self.layout.tp == 0


# Messages up to this size take the one-shot kernel: decode's all-reduces ([T, 6144] bf16
# after attention, fp32 after the MoE) up to 85 / 42 tokens.
CUSTOM_ALL_REDUCE_MAX_BYTES = 1 << 20
CUSTOM_ALL_REDUCE_MAX_RANKS = 8


def custom_all_reduce_refusal(device: torch.device, size: int, disabled: bool) -> str | None:
    """Why a group of `size` ranks on `device` uses its backend alone for all-reduces (None:
    it tries the one-shot IPC kernel first)."""
    if disabled:
        return "--disable-custom-all-reduce"
    if device.type != "cuda":
        return f"the one-shot all-reduce needs CUDA devices, not {device.type}"
    if size < 2:
        return "one rank: nothing to reduce"
    if size > CUSTOM_ALL_REDUCE_MAX_RANKS:
        return f"{size} ranks (the one-shot all-reduce takes at most {CUSTOM_ALL_REDUCE_MAX_RANKS})"
    return None


def build_fast_all_reduce(group_cpu, rank: int, size: int, device: torch.device, disabled: bool,
                          max_bytes: int = CUSTOM_ALL_REDUCE_MAX_BYTES):
    """A `OneShotAllReduce` over the ranks of `group_cpu` (a gloo group, used once to swap
    the IPC handles), or None where `custom_all_reduce_refusal` says so or the peers' buffers
    cannot be mapped (no peer access between the GPUs): then every message goes to NCCL.
    Every rank of the group calls this together, and agrees on the outcome."""
    import logging

    log = logging.getLogger(__name__)
    reason = custom_all_reduce_refusal(device, size, disabled)
    if reason is not None:
        if size > 1:
            log.info("TP all-reduce: NCCL only (%s)", reason)
        return None
    from m3serve.kernels.allreduce import IpcBuffers, OneShotAllReduce

    def exchange(obj):
        out = [None] * size
        dist.all_gather_object(out, obj, group=group_cpu)
        return out

    def attempt(step):
        """Run `step` on every rank; every rank learns whether any failed (no rank may skip a
        collective the others are in)."""
        try:
            result, error = step(), None
        except (RuntimeError, OSError) as e:      # CUDA OOM, IPC refused (no peer access)
            result, error = None, f"{type(e).__name__}: {e}"
        failed = [f for f in exchange(error) if f is not None]
        return result, (failed[0] if failed else None)

    buffers, error = attempt(lambda: IpcBuffers(rank, size, max_bytes, device))
    if error is None:
        handles = exchange(buffers.handles())
        _, error = attempt(lambda: buffers.map(handles))
    if error is not None:
        log.warning("TP all-reduce: NCCL only (the one-shot kernel's buffers could not be "
                    "shared: %s)", error)
        return None
    log.info("TP all-reduce: one-shot IPC kernel up to %d bytes, NCCL above", max_bytes)
    return OneShotAllReduce(buffers)


def init_rank_groups(layout: RankLayout, rank: int, master_addr: str, master_port: int,
                     device: torch.device, enable_expert_parallel: bool,
                     timeout_s: float, disable_custom_all_reduce: bool = False) -> RankGroups:
    """Join the world (NCCL on CUDA, gloo on CPU) and create the explicit groups. Every rank
    creates every group in the same order, as torch.distributed requires. TP groups on CUDA get
    the one-shot all-reduce for small messages (`build_fast_all_reduce`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://{_host(master_addr)}:{master_port}",
                            rank=rank, world_size=layout.world_size, timeout=timeout, **kwargs)
    tp_group = dp_group = tp_cpu = dp_cpu = None
    for d in range(layout.dp):
        ranks = layout.tp_group_ranks(d)
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        g_cpu = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if rank in ranks:
            tp_group, tp_cpu = g, g_cpu
    for t in range(layout.tp):
        ranks = layout.dp_group_ranks(t)
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            dp_group = g
    leaders = layout.dp_group_ranks(0)
    g = dist.new_group(leaders, backend="gloo", timeout=timeout)
    if rank in leaders:
        dp_cpu = g
    world_cpu = dist.new_group(list(range(layout.world_size)), backend="gloo", timeout=timeout)
    fast = build_fast_all_reduce(tp_cpu, layout.tp_rank(rank), layout.tp, device,
                                 disable_custom_all_reduce)
    parallel = ParallelInfo(
        tp=GroupInfo(layout.tp_rank(rank), layout.tp, tp_group, fast),
        dp=GroupInfo(layout.dp_rank(rank), layout.dp, dp_group),
        enable_expert_parallel=enable_expert_parallel)
    if device.type == "cuda":   # create the NCCL communicators now, before any graph capture
        probe = torch.ones(1, device=device)
        parallel.tp.all_reduce(probe)
        parallel.dp.all_reduce(probe)
        torch.cuda.synchronize(device)
    return RankGroups(layout, rank, parallel, tp_cpu, dp_cpu, world_cpu)


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def destroy_rank_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
