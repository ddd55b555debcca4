"""The worker sides of the KV connectors one rank runs, by the engine's configuration, in the
order of their scheduler sides (`engine/kv_connectors.py`)."""
from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


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
