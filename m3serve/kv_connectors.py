"""Which KV connectors an engine runs, by its configuration: the engine layer's wiring, so that
the core knows only the connector interface (`core/kv_connector`) and imports no transport.

`--kv-transfer-config` adds P/D transfer ("nixl", `disagg/`); the CPU tier's connector
(`--kv-offloading-size`) is built by the engine core beside the KV manager that keeps its books.
A new tier or transport adds its scheduler side here and its worker side in `worker/worker.py`.
"""
from __future__ import annotations


def scheduler_connectors(config, executor) -> list:
    """The scheduler sides of the connectors that move KV between engines (in the order the
    scheduler asks them at admission)."""
    parts = []
    if config.kv_transfer.enabled:
        from m3serve.disagg.connector import KVTransferScheduler
        parts.append(KVTransferScheduler(config.kv_transfer, executor.block_size, executor.num_blocks,
                                         executor.kv_rank_metadata()))
    return parts
