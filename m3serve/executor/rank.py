"""A rank process: joining the world (device, process groups, CPU threads), agreeing on the KV
block count, and the follower loop that runs what its leader broadcasts.

A follower is every rank but a DP replica's TP rank 0: it holds a model shard and a KV cache,
runs each step it is sent in lock step with its leader, and never samples or answers anyone
but its leader.
"""
from __future__ import annotations

import logging
import os
import signal

import msgspec
import torch
import torch.distributed as dist

from m3serve import envs
from m3serve.rank_layout import RankLayout
from m3serve.config import EngineConfig
from m3serve.distributed import RankGroups, destroy_rank_groups, init_rank_groups
from m3serve.executor.control import ControlChannel, Describe, RunStep, Stop
from m3serve.executor.supervisor import start_heartbeat

logger = logging.getLogger(__name__)



def join_world(config: EngineConfig, rank: int, master_port: int) -> tuple[RankGroups, torch.device]:
    """This process becomes global rank `rank`: its device (GPU = local rank), its CPU thread
    share, and every process group."""
    from m3serve.worker.worker import resolve_device

    layout = RankLayout.of(config.parallel)
    device = resolve_device(config.model.device, layout.local_rank(rank))
    if device.type == "cpu":           # ranks of one host share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.per_node))
    else:
        torch.cuda.set_device(device)
    p = config.parallel
    groups = init_rank_groups(layout, rank, p.master_addr, master_port, device,
                              p.enable_expert_parallel, p.distributed_timeout_seconds,
                              p.disable_custom_all_reduce)
    return groups, device


def agree_num_blocks(groups: RankGroups, worker) -> int:
    """Every rank sizes its KV cache (and its share of the CPU tier); the engine uses the
    smallest counts, so that one block id (one CPU slot) means a page on every rank. Allocates
    them."""
    counts = torch.tensor([worker.available_blocks(), worker.available_cpu_blocks()], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=groups.world_cpu)
    num_blocks, num_cpu_blocks = counts.tolist()
    worker.initialize(num_blocks, num_cpu_blocks)
    return num_blocks


def gather_kv_metadata(channel: ControlChannel | None, worker) -> list | None:
    """Every rank's KV-transfer metadata (agent, cache planes), at the leader in TP order."""
    from m3serve.disagg import messages

    mine = worker.kv_connector.find("nixl").rank_metadata()
    if channel is None:
        return [mine]
    parts = channel.gather_bytes(messages.encode(mine))
    return None if parts is None else [messages.decode_rank_metadata(p) for p in parts]


_KV_REPORTS_DECODER = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


def gather_kv_reports(channel: ControlChannel | None, worker) -> dict[str, list] | None:
    """Every rank's KV-connector reports of this step, at the leader: {connector name: reports
    in TP order} (the other ranks' as `msgspec.Raw`, decoded by the connector's scheduler side)."""
    mine = worker.kv_reports
    if channel is None:
        return {name: [r] for name, r in mine.items()}
    parts = channel.gather_bytes(msgspec.msgpack.encode(mine))
    if parts is None:
        return None
    ranks = [mine] + [_KV_REPORTS_DECODER.decode(p) for p in parts[1:]]
    return {name: [r[name] for r in ranks] for name in mine}


def rank_report(worker, groups: RankGroups) -> dict:
    return {**worker.describe(), "rank": groups.rank, "world_size": groups.layout.world_size}


def run_follower(config: EngineConfig, model_dir: str, rank: int, master_port: int,
                 beats=None, slot: int = 0) -> None:
    """Spawn target of a follower rank."""
    logging.basicConfig(level=envs.log_level(), format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the API process handles Ctrl-C
    start_heartbeat(beats, slot)
    try:
        _follow(config, model_dir, rank, master_port)
    except Exception:
        logger.exception("rank %d failed", rank)
        os._exit(1)
    os._exit(0)      # skip interpreter teardown of live communicators


def _follow(config: EngineConfig, model_dir: str, rank: int, master_port: int) -> None:
    from m3serve.worker.worker import Worker

    groups, device = join_world(config, rank, master_port)
    worker = Worker(config, model_dir, groups.parallel, device, is_driver=False, progress=False)
    agree_num_blocks(groups, worker)
    layout = groups.layout
    channel = ControlChannel(groups.tp_cpu, layout.leader_of(rank), layout.tp)
    if config.kv_transfer.enabled:
        gather_kv_metadata(channel, worker)
    while True:
        message = channel.recv()
        if isinstance(message, RunStep):
            so = message.scheduler_output
            worker.execute_model(so, message.dp)
            if so.kv_connector_metadata:
                gather_kv_reports(channel, worker)
        elif isinstance(message, Describe):
            channel.gather_reports(rank_report(worker, groups))
        elif isinstance(message, Stop):
            break
    worker.shutdown()
    destroy_rank_groups()
