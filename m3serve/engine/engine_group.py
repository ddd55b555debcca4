"""An engine as processes: its DP replicas' engine processes, the sockets that reach them, and
the book of which replica holds which request. Shared by the server's asyncio client and the
offline `LLM`'s blocking client.

One engine = data_parallel_size replicas, each an engine process that is the replica's leader
rank (it starts its own followers on its host). The front end (API process or offline `LLM`, on
node 0) binds one input socket per replica and one output socket that all replicas push to, and
starts the replicas whose leader lives on its host. Another host runs `m3serve serve ...
--node-rank N` (`run_headless`): it starts its replicas' leaders and the followers of replicas
led from another host, and watches them. One host: ipc sockets and a free rendezvous port;
several: TCP to master_addr.
"""
from __future__ import annotations

import logging
import multiprocessing
import random
import shutil
import socket
import sys
import tempfile
import time
import types
from contextlib import contextmanager

from m3serve.rank_layout import RankLayout
from m3serve.config import EngineConfig
from m3serve.protocol import EngineDead, EngineReady, EngineStats

logger = logging.getLogger(__name__)

DEFAULT_MULTI_NODE_MASTER_PORT = 29500


_PORTS_GIVEN: set[int] = set()      # ports free_port has handed out in this process
_LOWEST_PORT = 10000


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; else IANA's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive TCP ports that can be bound on every interface now and
    that this process has not handed out before.

    They lie outside the kernel's ephemeral range when there is room: a port the kernel gave
    (bind to port 0) can be taken by any outgoing connection's local end before its owner binds
    it, which a busy test run or a host starting many processes does hit."""
    low, high = _ephemeral_ports()
    # every first port of a run that fits below or above the ephemeral range
    firsts = [*range(_LOWEST_PORT, low - count + 1), *range(high + 1, 65536 - count + 1)]
    firsts = firsts or list(range(1024, 65536 - count + 1))
    rng = random.Random()
    for _ in range(200):
        base = rng.choice(firsts)
        ports = range(base, base + count)
        if not _PORTS_GIVEN.intersection(ports) and all(_bindable(p) for p in ports):
            _PORTS_GIVEN.update(ports)
            return base
    raise RuntimeError(f"found no {count} consecutive free TCP ports")



class EngineEndpoints:
    """Addresses of the engine's sockets, and the torch.distributed rendezvous port."""

    def __init__(self, config: EngineConfig):
        p = config.parallel
        dp = p.data_parallel_size
        self._dir = None
        if p.nnodes == 1:
            self._dir = tempfile.mkdtemp(prefix="m3serve-ipc-")
            self.inputs = [f"ipc://{self._dir}/input-{d}" for d in range(dp)]
            self.output = f"ipc://{self._dir}/output"
            self.bind_inputs, self.bind_output = self.inputs, self.output
            self.master_port = p.master_port or free_port()
        else:
            host, port = p.master_addr, p.data_parallel_rpc_port
            self.output = f"tcp://{host}:{port}"
            self.inputs = [f"tcp://{host}:{port + 1 + d}" for d in range(dp)]
            self.bind_output = f"tcp://*:{port}"
            self.bind_inputs = [f"tcp://*:{port + 1 + d}" for d in range(dp)]
            self.master_port = p.master_port or DEFAULT_MULTI_NODE_MASTER_PORT

    def cleanup(self) -> None:
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


@contextmanager
def _without_user_main():
    """Spawned children re-run the parent's `__main__` (the user's script) before their target,
    unless it has neither a path nor a module name. An engine process needs nothing from it (its
    target and arguments are m3serve's), and re-running it is what breaks a script without an
    `if __name__ == "__main__":` guard (the child would build the engine again, mid-bootstrap)
    or a script read from standard input (`python -`: no file to re-run). So while the engine
    processes start, `__main__` is a blank module."""
    user_main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if user_main is not None:
            sys.modules["__main__"] = user_main


class EngineProcesses:
    """The engine processes (replica leaders) this host starts."""

    def __init__(self, config: EngineConfig, endpoints: EngineEndpoints):
        self.config, self.endpoints = config, endpoints
        layout = RankLayout.of(config.parallel)
        node = config.parallel.node_rank
        self.local_replicas = [d for d in range(layout.dp) if layout.node_of(d * layout.tp) == node]
        self.procs: dict[int, multiprocessing.Process] = {}

    def start(self) -> None:
        from m3serve.engine.engine_proc import run_engine_process

        ctx = multiprocessing.get_context("spawn")  # never fork: CUDA and threads do not survive it
        for d in self.local_replicas:
            # not a daemon: a replica leader starts its own follower processes
            proc = ctx.Process(target=run_engine_process, name=f"m3serve-engine{d}",
                               args=(self.config, self.endpoints.inputs[d], self.endpoints.output, d,
                                     self.endpoints.master_port))
            with _without_user_main():
                proc.start()
            self.procs[d] = proc

    def dead_reason(self) -> str | None:
        for d, proc in self.procs.items():
            if not proc.is_alive():
                return f"engine replica {d} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def stop(self, grace_s: float = 5.0) -> None:
        """Wait up to `grace_s` for processes told to shut down, then terminate, then kill."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(3.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        self.procs.clear()


def send_shutdown(pushes) -> None:
    """Tell every replica to stop (each socket's send only queues; failures are ignored)."""
    import zmq

    from m3serve import protocol

    for push in pushes:
        try:
            push.send(protocol.encode(protocol.Shutdown()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass


class ReplicaBook:
    """Which replica serves which sequence, the load per replica (requests are placed on the
    least loaded), readiness and the stats each replica last reported."""

    def __init__(self, dp_size: int):
        self.dp_size = dp_size
        self.owner: dict[str, int] = {}
        self.load = [0] * dp_size
        self.ready: dict[int, EngineReady] = {}
        self.stats_by_replica: dict[int, EngineStats] = {}

    def choose(self) -> int:
        return min(range(self.dp_size), key=lambda d: self.load[d])

    def place(self, replica: int, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.owner[rid] = replica
        self.load[replica] += len(request_ids)

    def release(self, request_id: str) -> int | None:
        replica = self.owner.pop(request_id, None)
        if replica is not None:
            self.load[replica] -= 1
        return replica

    def by_replica(self, request_ids) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self.owner:
                out.setdefault(self.owner[rid], []).append(rid)
        return out

    def note_startup(self, message) -> str | None:
        """Record an EngineReady; an EngineDead at start-up returns the failure."""
        if isinstance(message, EngineDead):
            return f"engine replica {message.dp_rank} failed to start: {message.message}"
        if isinstance(message, EngineReady):
            self.ready[message.dp_rank] = message
        return None

    @property
    def all_ready(self) -> bool:
        return len(self.ready) == self.dp_size

    def info(self) -> EngineReady:
        """Replica 0's announcement, with the smallest pool of any replica."""
        first = self.ready[0]
        usable = min(r.num_usable_blocks for r in self.ready.values())
        return EngineReady(max_model_len=first.max_model_len, block_size=first.block_size,
                           num_usable_blocks=usable, vocab_size=first.vocab_size,
                           eos_token_id=first.eos_token_id, dp_rank=0, world_size=first.world_size,
                           max_waiting_requests=first.max_waiting_requests, media_refusal=first.media_refusal)

    @staticmethod
    def combine(stats: list[EngineStats]) -> EngineStats:
        """The engine's stats: counts summed over replicas, usage over the summed pools."""
        if len(stats) == 1:
            return stats[0]
        total = EngineStats()
        for name in ("num_running", "num_waiting", "num_free_blocks", "num_usable_blocks",
                     "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps",
                     "num_step_errors", "spec_num_drafts", "spec_num_draft_tokens",
                     "spec_num_accepted_tokens", "iteration_tokens_sum", "external_prefix_cache_queries",
                     "external_prefix_cache_hits", "kv_offload_bytes_to_cpu", "kv_offload_bytes_to_gpu",
                     "kv_offload_seconds_to_cpu", "kv_offload_seconds_to_gpu", "kv_offload_evictions",
                     "kv_offload_num_slots", "mm_encoder_cache_queries", "mm_encoder_cache_hits",
                     "mm_encoder_cache_evictions", "mm_encoder_cache_bytes"):
            setattr(total, name, sum(getattr(s, name) for s in stats))
        if total.kv_offload_num_slots:
            total.kv_offload_usage = sum(s.kv_offload_usage * s.kv_offload_num_slots
                                         for s in stats) / total.kv_offload_num_slots
        total.iteration_token_counts = [sum(col) for col in zip(*(s.iteration_token_counts for s in stats))]
        total.spec_accepted_per_position = [sum(col) for col in zip(*(s.spec_accepted_per_position
                                                                      for s in stats))]
        total.spec_synthetic_acceptance = any(s.spec_synthetic_acceptance for s in stats)
        if total.num_usable_blocks:
            total.kv_cache_usage = 1.0 - total.num_free_blocks / total.num_usable_blocks
        return total


def run_headless(config: EngineConfig) -> int:
    """`m3serve serve ... --node-rank N` (N > 0): start this host's ranks of the engine whose
    front end runs on node 0, watch them, and exit when they end (non-zero if one failed)."""
    from m3serve.executor.rank import run_follower
    from m3serve.executor.supervisor import Supervisor

    from m3serve.model.files import model_directory

    layout, node = RankLayout.of(config.parallel), config.parallel.node_rank
    model_dir = str(model_directory(config.model.model))
    endpoints = EngineEndpoints(config)
    engines = EngineProcesses(config, endpoints)
    engines.start()
    ctx = multiprocessing.get_context("spawn")
    local = layout.node_ranks(node)
    beats = ctx.Array("d", len(local), lock=False)
    failed: list[str] = []
    supervisor = Supervisor(failed.append, beats)
    for d, proc in engines.procs.items():
        supervisor.watch(d * layout.tp, proc)
    for slot, r in enumerate(local):
        if layout.node_of(layout.leader_of(r)) == node:
            continue                    # started by its leader on this host
        proc = ctx.Process(target=run_follower, name=f"m3serve-rank{r}", daemon=True,
                           args=(config, model_dir, r, endpoints.master_port, beats, slot))
        proc.start()
        supervisor.watch(r, proc, slot)
    logger.info("node %d of %d: ranks %s of %d started (headless)", node, config.parallel.nnodes,
                local, layout.world_size)
    supervisor.start()
    try:
        while not failed and any(p.is_alive() for p, _ in supervisor.procs.values()):
            time.sleep(0.5)
    except KeyboardInterrupt:
        failed.append("interrupted")
    supervisor.stop()
    supervisor.terminate_all()
    engines.stop(grace_s=0)
    if failed and supervisor.failure_exit_code == 0:
        return 0                        # the front end shut the engine down
    if failed:
        print(f"m3serve: node {node}: {failed[0]}", file=sys.stderr)
        return 1
    return 0
