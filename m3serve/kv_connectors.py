"""Which KV connectors an engine runs, by its configuration: the engine layer's wiring, so that
the core knows only the connector interface (`core/kv_connector`) and imports no transport.

`--kv-transfer-config` adds P/D transfer ("nixl", `disagg/`), `--kv-offloading-size` the CPU
tier ("cpu_tier": its scheduler side is built by the engine core beside the KV manager that keeps
its books). A new tier or transport adds its two sides here and nowhere else.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


def scheduler_connectors(config, executor) -> list:
    """The scheduler sides of the connectors that move KV between engines (in the order the
    scheduler asks them at admission)."""
    parts = []
    if config.kv_transfer.enabled:
        from m3serve.disagg.connector import KVTransferScheduler
        parts.append(KVTransferScheduler(config.kv_transfer, executor.block_size, executor.num_blocks,
                                         executor.kv_rank_metadata()))
    return parts


def worker_connectors(config, worker) -> list:
    """The worker sides for one rank, once its KV caches are allocated (the same connectors,
    in the same order, as the scheduler's)."""
    parts = []
    if config.kv_transfer.enabled:
        from m3serve.disagg.connector import make_worker_connector
        connector = make_worker_connector(config.kv_transfer, worker.parallel.tp.rank, worker.device)
        connector.register_kv_caches(worker.transfer_planes())
        parts.append(connector)
    if worker.num_cpu_blocks:
        from m3serve.worker.kv_offload import KVOffloadWorker
        start = time.perf_counter()
        offload = KVOffloadWorker(worker.cache_planes(), worker.num_cpu_blocks, worker.device)
        logger.info("CPU tier: %d blocks (%.2f GiB of %shost memory on this rank) in %.1f s",
                    worker.num_cpu_blocks, worker.num_cpu_blocks * offload.bytes_per_block / (1 << 30),
                    "pinned " if offload.cuda else "", time.perf_counter() - start)
        parts.append(offload)
    return parts
