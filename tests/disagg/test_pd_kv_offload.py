"""P/D with the CPU tier on both sides: a prefill worker whose prompt came back from its tier
hands the decode worker exactly the KV it would have computed, and a decode worker's pulled
blocks enter its own tiers like any other; every decode leg gives the tokens of one engine
without P/D or tier. Engines run in this process, stepped by hand."""
import json
import time

import torch
from test_pd_poisoned_cache import _run

from m3serve.config import EngineConfig
from m3serve.kv_transfer_params import KVTransferParams, parse_kv_transfer_params
from m3serve.llm import LLMEngine
from m3serve.protocol import EngineCoreRequest
from m3serve.sampling_params import SamplingParams

BYTES_PER_TOKEN = 2944          # fp32 tiny model: main K/V + index keys
SMALL = dict(dtype="float32", max_num_batched_tokens=32, kv_cache_memory=14 * 16 * BYTES_PER_TOKEN,
             kv_offloading_size=64 * 16 * BYTES_PER_TOKEN / (1 << 30))


def _engine(model_dir, role=None, **flags) -> LLMEngine:
    if role is not None:
        flags["kv_transfer_config"] = json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                  "kv_connector_extra_config": {"abort_request_timeout": 30}})
    return LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **flags), progress=False)


def _ids(n, seed):
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drain(*engines):
    for _ in range(2000):
        busy = [e for e in engines if e.core.has_unfinished_requests()]
        if not busy:
            break
        for e in busy:
            e.core.step()
        time.sleep(0.001)
    for e in engines:
        e.core.scheduler.check_integrity()


def test_pd_with_a_cpu_tier_on_both_sides(tiny_dir):
    plain = _engine(tiny_dir, dtype="float32")
    producer = _engine(tiny_dir, "kv_producer", **SMALL)
    consumer = _engine(tiny_dir, "kv_consumer", **SMALL)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    try:
        first = _ids(100, 41)
        turns = [first, _ids(120, 42), _ids(110, 43), first + _ids(20, 44)]
        for n, ids in enumerate(turns):
            want = _run(plain, EngineCoreRequest(f"ref{n}", ids, greedy, None, time.time()))[0]
            _, _, params = _run(producer, EngineCoreRequest(
                f"p{n}", ids, SamplingParams(temperature=0, max_tokens=1), None, time.time(),
                kv_transfer_params=KVTransferParams(do_remote_decode=True)))
            got = _run(consumer, EngineCoreRequest(f"d{n}", ids, greedy, None, time.time(),
                                                   kv_transfer_params=parse_kv_transfer_params(params)))[0]
            assert got == want, n
            _drain(producer, consumer)          # releases reach the producer; copies land
        assert producer.core.scheduler.num_kv_loads == 1    # turn 4's prefix came from its tier
        assert consumer.core.scheduler.connector.find("nixl").stats.pulls_done == 4
        for e in (producer, consumer):
            kv = e.core.kv_manager
            assert kv.num_free_blocks == kv.num_usable_blocks and kv.offload.references() == ({}, {})
            assert kv.offload.stats.blocks_to_cpu > 0
    finally:
        producer.shutdown()
        consumer.shutdown()
