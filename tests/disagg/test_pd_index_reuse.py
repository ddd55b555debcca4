"""P/D with cross-layer top-k reuse: the skipping layers have no index cache, so the producer
offers and the consumer pulls index planes of the indexer layers only; with the consumer's caches
NaN-poisoned first, its greedy tokens equal the dense reference's that skips the same way. A
consumer without reuse is refused by the producer's layout, naming the planes that differ."""
import json
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from m3serve.config import EngineConfig
from m3serve.disagg.layout import LayoutMismatch, check_compatible
from m3serve.disagg.params import KVTransferParams, parse_kv_transfer_params
from m3serve.llm import LLMEngine
from m3serve.model.config import load_config
from m3serve.model.reference import ReferenceM3
from m3serve.protocol import EngineCoreRequest
from m3serve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from refgreedy import canonical_weights, reference_greedy  # noqa: E402
from test_pd_poisoned_cache import _run  # noqa: E402

REUSE = {"text_config": {"use_index_cache": True, "index_topk_freq": 2}}    # layers 1 and 3 index


def _engine(model_dir, role: str, overrides=REUSE) -> LLMEngine:
    config = EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", hf_overrides=overrides,
                                      kv_transfer_config=json.dumps({"kv_connector": "NixlConnector",
                                                                     "kv_role": role}))
    return LLMEngine(config, progress=False)


def _index_planes(engine: LLMEngine) -> list[str]:
    return sorted(r.name for r in engine.worker.kv_connector.regions if r.name.endswith(".index"))


def test_consumer_pulls_the_indexer_layers_caches(tiny_dir):
    producer = _engine(tiny_dir, "kv_producer")
    consumer = _engine(tiny_dir, "kv_consumer")
    try:
        assert _index_planes(producer) == _index_planes(consumer) == ["1.index", "3.index"]
        for plane in [*consumer.worker.runner.kv_caches, *consumer.worker.runner.index_caches]:
            if plane is not None:
                plane.fill_(float("nan"))
        ids = torch.randint(0, 2000, (95,), generator=torch.Generator().manual_seed(31)).tolist()
        want = reference_greedy(ReferenceM3(load_config(tiny_dir, REUSE), canonical_weights(tiny_dir)), ids, 6)
        _, _, params = _run(producer, EngineCoreRequest(
            f"prefill-{uuid.uuid4().hex}", ids, SamplingParams(temperature=0, max_tokens=1), None, time.time(),
            kv_transfer_params=KVTransferParams(do_remote_decode=True)))
        got, _, _ = _run(consumer, EngineCoreRequest(
            f"decode-{uuid.uuid4().hex}", ids, SamplingParams(temperature=0, max_tokens=6), None, time.time(),
            kv_transfer_params=parse_kv_transfer_params(params)))
        stats = consumer.core.scheduler.connector.stats
        assert (stats.pulls_done, stats.fallbacks) == (1, 0)
        assert got == want
        exact = _engine(tiny_dir, "kv_consumer", overrides=None)
        try:
            with pytest.raises(LayoutMismatch, match=r"missing there: \['2.index'\], extra there: \[\]"):
                check_compatible(exact.worker.kv_connector.regions, producer.worker.kv_connector.regions, 16, 16)
        finally:
            exact.shutdown()
    finally:
        consumer.shutdown()
        producer.shutdown()
