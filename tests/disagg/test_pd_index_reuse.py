"""P/D with cross-layer top-k reuse: the skipping layers have no index cache, so the producer
offers and the consumer pulls index planes of the indexer layers only; with the consumer's caches
NaN-poisoned first, its greedy tokens equal the dense reference's that skips the same way. A
consumer without reuse is refused by the producer's layout, naming the planes that differ."""
import sys
from pathlib import Path

import pytest
import torch

from m3serve.disagg.layout import LayoutMismatch, check_compatible
from m3serve.llm import LLMEngine
from m3serve.model.config import load_config
from m3serve.model.reference import ReferenceM3

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from refgreedy import canonical_weights, reference_greedy  # noqa: E402
from test_pd_m31 import _engine as pd_engine, _index_planes, poison, pulled_greedy  # noqa: E402

REUSE = {"text_config": {"use_index_cache": True, "index_topk_freq": 2}}    # layers 1 and 3 index


def _engine(model_dir, role: str, overrides=REUSE) -> LLMEngine:
    return pd_engine(model_dir, role, overrides)


def test_consumer_pulls_the_indexer_layers_caches(tiny_dir):
    producer = _engine(tiny_dir, "kv_producer")
    consumer = _engine(tiny_dir, "kv_consumer")
    try:
        assert _index_planes(producer) == _index_planes(consumer) == ["1.index", "3.index"]
        poison(consumer)
        ids = torch.randint(0, 2000, (95,), generator=torch.Generator().manual_seed(31)).tolist()
        want = reference_greedy(ReferenceM3(load_config(tiny_dir, REUSE), canonical_weights(tiny_dir)), ids, 6)
        assert pulled_greedy(producer, consumer, ids, 6) == want
        exact = _engine(tiny_dir, "kv_consumer", overrides=None)
        try:
            with pytest.raises(LayoutMismatch, match=r"missing there: \['2.index'\], extra there: \[\]"):
                check_compatible(exact.worker.kv_connector.regions, producer.worker.kv_connector.regions, 16, 16)
        finally:
            exact.shutdown()
    finally:
        consumer.shutdown()
        producer.shutdown()
