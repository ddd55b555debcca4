"""Which KV connectors an engine runs, by its configuration (the scheduler sides; the ranks'
sides are `worker/kv_connectors.py`, in the same order). The core knows only the connector
interface (`core/kv_connector`) and imports no transport.

`--kv-transfer-config` adds P/D transfer ("nixl", `disagg/`); `--kv-offloading-size` the CPU
tier ("cpu_tier", whose books the KV manager keeps). A new tier or transport adds its scheduler
side here and its worker side there.
"""
from __future__ import annotations


def scheduler_connectors(config, executor, kv_manager) -> list:
    """The scheduler sides of the connectors, in the order the scheduler asks them at admission:
    P/D first (a decode leg's pull is never a tier's hit), then the CPU tier."""
    parts = []
    if config.kv_transfer.enabled:
        from m3serve.disagg.connector import KVTransferScheduler
        geo = executor.geometry()
        parts.append(KVTransferScheduler(config.kv_transfer, geo.block_size, geo.num_blocks,
                                         executor.kv_rank_metadata()))
    if kv_manager.offload is not None:
        from m3serve.core.kv_cache.offload import CPUTierConnector
        parts.append(CPUTierConnector(kv_manager))
    return parts
