"""One lane for KV that arrives from elsewhere: the KV-connector interface (`base`) and the
composite that runs several connectors side by side (`multi`). Concrete connectors live beside
what they move: the CPU tier in `core/kv_cache/offload.py` and `worker/kv_offload.py`, P/D
transfer over NIXL in `disagg/`; `engine/kv_connectors.py` and `worker/kv_connectors.py` build
their two sides.
"""
from m3serve.core.kv_connector.base import (ExternalHit, KVConnectorScheduler, KVConnectorWorker,
                                            as_struct)
from m3serve.core.kv_connector.multi import MultiConnectorScheduler, MultiConnectorWorker, combine

__all__ = ["ExternalHit", "KVConnectorScheduler", "KVConnectorWorker", "MultiConnectorScheduler",
           "MultiConnectorWorker", "as_struct", "combine"]
