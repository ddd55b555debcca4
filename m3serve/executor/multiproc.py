"""The executor of a multi-rank engine, living in a DP replica's leader rank (TP rank 0, where
that replica's engine core runs).

It spawns the replica's followers that live on this host, joins the world, and per step:
agrees with the other replicas' leaders on the step's shape (when there are several: their MoE
layers exchange tokens, so every replica runs a forward, a padding one when idle), broadcasts
the `SchedulerOutput` to its followers, and runs its own shard. Only its sampled tokens come
back. A follower that exits, stops its heartbeat, or a step that outlives the collective
timeout, is fatal: `on_fatal(message naming the rank)` is called from the watch thread, and a
step that fails raises `ExecutorFailure`.
"""
from __future__ import annotations

import logging
import multiprocessing
import time

import torch
import torch.distributed as dist

from m3serve.config import EngineConfig
from m3serve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from m3serve.distributed import destroy_rank_groups
from m3serve.executor import EngineGeometry, ExecutorFailure, ReplicasStopping, geometry_of
from m3serve.executor.control import ControlChannel, Describe, RunStep, Stop
from m3serve.executor.rank import (agree_num_blocks, gather_kv_metadata, gather_kv_reports, join_world,
                                   rank_report, run_follower)
from m3serve.executor.supervisor import HEARTBEAT_PERIOD_S, Supervisor
from m3serve.rank_layout import RankLayout
from m3serve.worker.model_runner import DPStep

logger = logging.getLogger(__name__)


def _check_devices(config: EngineConfig, per_node: int) -> None:
    device = config.model.device
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return
    count = torch.cuda.device_count()
    if per_node > count:
        p = config.parallel
        raise ValueError(f"{per_node} ranks per host (tensor_parallel_size {p.tensor_parallel_size} x "
                         f"data_parallel_size {p.data_parallel_size} / nnodes {p.nnodes}) need "
                         f"{per_node} GPUs, but this host has {count}")


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, model_dir, rank: int, master_port: int, on_fatal,
                 progress: bool = False):
        self.config, self.rank, self.on_fatal = config, rank, on_fatal
        self.layout = layout = RankLayout.of(config.parallel)
        self.needs_lockstep = layout.dp > 1
        self.global_busy = False          # whether any replica had work at the last agreement
        self.stop_requested = False       # this replica was told to shut down (`request_stop`)
        self._step_started: float | None = None
        _check_devices(config, layout.per_node)
        ctx = multiprocessing.get_context("spawn")
        self.beats = ctx.Array("d", layout.tp, lock=False)
        timeout = config.parallel.distributed_timeout_seconds
        self.supervisor = Supervisor(self._fatal, self.beats, extra_check=self._step_overdue)
        self._timeout = timeout
        node = layout.node_of(rank)
        for r in layout.tp_group_ranks(layout.dp_rank(rank)):
            if r == rank or layout.node_of(r) != node:
                continue                  # followers on other hosts are started there
            proc = ctx.Process(target=run_follower, name=f"m3serve-rank{r}", daemon=True,
                               args=(config, str(model_dir), r, master_port, self.beats, layout.tp_rank(r)))
            proc.start()
            self.supervisor.watch(r, proc, layout.tp_rank(r))
        self.supervisor.start()
        from m3serve.worker.worker import Worker

        self.groups, device = join_world(config, rank, master_port)
        self.worker = Worker(config, model_dir, self.groups.parallel, device, is_driver=True,
                             progress=progress)
        # every rank holds its own shard of a block: the CPU tier moves tp shards per block
        self._geometry = geometry_of(self.worker, model_dir, agree_num_blocks(self.groups, self.worker), layout.tp)
        self.channel = (ControlChannel(self.groups.tp_cpu, rank, layout.tp) if layout.tp > 1 else None)
        self._kv_ranks = None
        if config.kv_transfer.enabled:
            self._kv_ranks = gather_kv_metadata(self.channel, self.worker)
        logger.info("rank %d of %d: TP %d x DP %d%s, %d KV blocks", rank, layout.world_size, layout.tp,
                    layout.dp, " with expert parallelism" if config.parallel.enable_expert_parallel
                    else "", self._geometry.num_blocks)

    # ------------------------------------------------------------ failure

    def _step_overdue(self) -> str | None:
        started = self._step_started
        if started is not None and time.monotonic() - started > self._timeout:
            return (f"an engine step on rank {self.rank} has not finished after {self._timeout} s "
                    f"(--distributed-timeout-seconds): a rank is stuck in a collective")
        return None

    def _fatal(self, message: str) -> None:
        self.supervisor.terminate_all()
        self.on_fatal(message)

    # ------------------------------------------------------------ steps

    def request_stop(self) -> None:
        """Lock step: leave together. The next agreement tells every replica to stop (none
        may leave the others waiting in a collective): that step raises `ReplicasStopping`."""
        self.stop_requested = True

    def _agree(self, so: SchedulerOutput) -> DPStep | None:
        """All replicas' leaders: the step's largest shape, or None when nobody has work;
        raises `ReplicasStopping` when a replica is stopping."""
        tokens, reqs = so.total_num_scheduled_tokens, len(so.num_scheduled_tokens)
        shape = torch.tensor([int(tokens > 0), tokens, reqs, int(tokens != reqs), int(self.stop_requested)],
                             dtype=torch.int64)
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.groups.dp_leaders_cpu)
        busy, tokens, reqs, mixed, stop = shape.tolist()
        if stop:
            raise ReplicasStopping()
        self.global_busy = bool(busy)
        if not busy:
            return None
        return DPStep(num_tokens=max(1, tokens), num_reqs=max(1, reqs), all_decode=not mixed)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        try:
            dp = self._agree(so) if self.needs_lockstep else None
            if (self.needs_lockstep and dp is None and not (so.finished_req_ids or so.preempted_req_ids)
                    and so.kv_connector_metadata is None):
                return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            self._step_started = time.monotonic()
            if self.channel is not None:
                self.channel.send(RunStep(so, dp))
            out = self.worker.execute_model(so, dp)
            if so.kv_connector_metadata:
                out.kv_connector_output = gather_kv_reports(self.channel, self.worker)
            return out
        except ReplicasStopping:
            raise
        except Exception as e:
            # a peer's death often surfaces first as a transport error in a collective
            reason = self.supervisor.failure_within(2 * HEARTBEAT_PERIOD_S) or f"{type(e).__name__}: {e}"
            raise ExecutorFailure(f"rank {self.rank}: engine step failed: {reason}") from e
        finally:
            self._step_started = None

    def geometry(self) -> EngineGeometry:
        return self._geometry

    def kv_rank_metadata(self) -> list:
        return self._kv_ranks

    def describe(self) -> list[dict]:
        """Reports of every rank of this replica, in TP order."""
        mine = rank_report(self.worker, self.groups)
        if self.channel is None:
            return [mine]
        self.channel.send(Describe())
        return self.channel.gather_reports(mine)

    def shutdown(self) -> None:
        self.supervisor.stop()
        try:
            if self.channel is not None:
                self.channel.send(Stop())
        except Exception:
            pass
        for proc, _ in self.supervisor.procs.values():
            proc.join(5)
        self.supervisor.terminate_all()
        self.worker.shutdown()
        destroy_rank_groups()
