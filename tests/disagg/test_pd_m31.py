"""P/D on MiniMax-M3.1-Flash's all-MSA tiny model: the producer offers, and the consumer pulls,
the index cache of every layer (the dense-MLP layers 0-1 included) beside the K/V planes; with the
consumer's caches NaN-poisoned first, its greedy tokens equal the dense reference's, so no plane
was left behind. An M3 consumer is refused by an M3.1 producer's layout, naming the planes."""
import json
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from m3serve.config import EngineConfig
from m3serve.disagg.layout import LayoutMismatch, check_compatible
from m3serve.kv_transfer_params import KVTransferParams, parse_kv_transfer_params
from m3serve.llm import LLMEngine
from m3serve.protocol import EngineCoreRequest
from m3serve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from refgreedy import reference_greedy, reference_model  # noqa: E402
from test_pd_poisoned_cache import _run  # noqa: E402


def _engine(model_dir, role: str, overrides=None) -> LLMEngine:
    config = EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", hf_overrides=overrides,
                                      kv_transfer_config=json.dumps({"kv_connector": "NixlConnector",
                                                                     "kv_role": role}))
    return LLMEngine(config, progress=False)


def _index_planes(engine: LLMEngine) -> list[str]:
    return sorted(r.name for r in engine.worker.kv_connector.regions if r.name.endswith(".index"))


def poison(engine: LLMEngine) -> None:
    """NaN into every KV and index plane of `engine`: only pulled blocks can give finite outputs."""
    for plane in [*engine.worker.runner.kv_caches, *engine.worker.runner.index_caches]:
        if plane is not None:
            plane.fill_(float("nan"))


def pulled_greedy(producer: LLMEngine, consumer: LLMEngine, ids: list[int], max_tokens: int) -> list[int]:
    """Prefill `ids` on the producer, decode `max_tokens` greedy tokens on the consumer from the
    pulled KV; asserts the pull happened (one pull, no fallback). Returns the consumer's tokens."""
    _, _, params = _run(producer, EngineCoreRequest(
        f"prefill-{uuid.uuid4().hex}", ids, SamplingParams(temperature=0, max_tokens=1), None, time.time(),
        kv_transfer_params=KVTransferParams(do_remote_decode=True)))
    got, _, _ = _run(consumer, EngineCoreRequest(
        f"decode-{uuid.uuid4().hex}", ids, SamplingParams(temperature=0, max_tokens=max_tokens), None,
        time.time(), kv_transfer_params=parse_kv_transfer_params(params)))
    stats = consumer.core.scheduler.connector.stats
    assert (stats.pulls_done, stats.fallbacks) == (1, 0)
    return got


def test_consumer_pulls_every_layers_index_cache(tiny_m31_dir, tiny_dir):
    producer = _engine(tiny_m31_dir, "kv_producer")
    consumer = _engine(tiny_m31_dir, "kv_consumer")
    try:
        assert _index_planes(producer) == _index_planes(consumer) == [f"{i}.index" for i in range(5)]
        poison(consumer)
        ids = torch.randint(0, 2000, (75,), generator=torch.Generator().manual_seed(31)).tolist()
        want = reference_greedy(reference_model(tiny_m31_dir), ids, 6)
        assert pulled_greedy(producer, consumer, ids, 6) == want
        m3 = _engine(tiny_dir, "kv_consumer")
        try:
            with pytest.raises(LayoutMismatch, match=r"missing there: \[\], extra there: \['0.index', '4.index'\]"):
                check_compatible(m3.worker.kv_connector.regions, producer.worker.kv_connector.regions, 16, 16)
        finally:
            m3.shutdown()
    finally:
        consumer.shutdown()
        producer.shutdown()
