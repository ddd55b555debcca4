"""Executors: how the engine core reaches its ranks. `uniproc` runs the one rank in-process;
`multiproc` is a DP replica's leader rank, which drives its TP followers (`rank`) over the
control channel (`control`) and keeps lock step with the other replicas; `supervisor` watches
rank processes.

Every executor offers: `geometry()` (`EngineGeometry`: what the engine core sizes itself by,
known once the ranks are up), `needs_lockstep` (the engine loop must step every iteration, work
or not), `execute_model(scheduler_output)`, `kv_rank_metadata()` (with P/D transfer: each rank's
KV layout for the handshake), `describe()` (one report per rank of the replica) and `shutdown()`.
Lock-step executors (DP replicas) also offer `request_stop()`: replicas leave together
(`ReplicasStopping` from the step where they agree), never one left waiting in a collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineGeometry:
    """The ranks' shape as the engine core needs it, the same from every executor."""
    model_config: object            # model.config.M3Config
    model_dir: str | Path
    device_type: str                # "cuda" or "cpu": the ranks' devices
    block_size: int
    num_blocks: int                 # KV blocks of every cache group, agreed by the ranks
    num_cpu_blocks: int = 0         # the CPU tier's blocks (0: no tier)
    cpu_block_bytes: int = 0        # bytes of one block over every cache group and rank (the tier's unit)
    draft_window: int = 0           # a window draft's (DSpark) window in tokens (0: none)
    num_draft_blocks: int = 0       # and its own pool's blocks
    has_vision: bool = False        # the ranks hold a vision encoder (images and videos accepted)
    encoder_bytes_per_token: int = 0    # bytes per placeholder token of an encoder output
    capture_sizes: tuple[int, ...] = ()  # batch sizes of the captured decode graphs


def geometry_of(worker, model_dir, num_blocks: int, tp: int = 1) -> EngineGeometry:
    """The geometry of a replica whose leader's worker is `worker` (its `tp` ranks each hold
    a shard of every block)."""
    tier = worker.cpu_tier
    return EngineGeometry(
        model_config=worker.model_config, model_dir=model_dir, device_type=worker.device.type,
        block_size=worker.block_size, num_blocks=num_blocks, num_cpu_blocks=worker.num_cpu_blocks,
        cpu_block_bytes=tier.bytes_per_block * tp if tier is not None else 0,
        draft_window=worker.draft_window, num_draft_blocks=worker.num_draft_blocks,
        has_vision=worker.runner.vision is not None, encoder_bytes_per_token=worker.encoder_bytes_per_token,
        capture_sizes=tuple(worker.capture_sizes))


class ExecutorFailure(RuntimeError):
    """The ranks can no longer run steps (a rank died, hung or a collective failed): fatal for
    the engine, unlike an error in one request."""


class ReplicasStopping(Exception):
    """The DP replicas agreed to shut down: the step did not run, the engine loop ends."""
