"""A decode worker computes from exactly the KV it pulled or recomputed, never from what its
blocks held before: with every consumer cache plane filled with NaN first, a pulled prompt, and a
prompt recomputed after a pull that failed inside NIXL or stalled past its timeout, give the
producer's greedy tokens and logprobs bit for bit (on CPU each query's attention and every
projection run in float64, so batching cannot change them). Engines run in this process, stepped
by hand, so the test controls the order of events without servers or timing."""
import json
import time
import uuid

import pytest
from pdutil import long_prompt

from m3serve.config import EngineConfig
from m3serve.kv_transfer_params import KVTransferParams, parse_kv_transfer_params
from m3serve.llm import LLMEngine
from m3serve.protocol import EngineCoreRequest
from m3serve.sampling_params import SamplingParams


def _engine(model_dir, role: str, **extra) -> LLMEngine:
    config = EngineConfig.from_kwargs(model=str(model_dir), kv_transfer_config=json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}))
    return LLMEngine(config, progress=False)


def _run(engine: LLMEngine, request: EngineCoreRequest, timeout_s: float = 60.0):
    """Step `engine` until `request` finishes: (token ids, per-token logprobs, kv_transfer_params)."""
    engine.core.add_requests([request])
    tokens, logprobs, params = [], [], None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for out in engine.core.step():
            if out.request_id != request.request_id:
                continue
            assert out.finish_reason != "error", out
            tokens += out.new_token_ids
            if out.new_logprobs is not None:
                logprobs.append(out.new_logprobs)
            params = out.kv_transfer_params or params
            if out.finish_reason is not None:
                return tokens, logprobs, params
        time.sleep(0.001)
    raise AssertionError(f"request {request.request_id} did not finish in {timeout_s} s")


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=3)


@pytest.fixture(scope="module")
def producer(tiny_dir):
    engine = _engine(tiny_dir, "kv_producer", abort_request_timeout=30)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("fault", [None, "fail", "stall"])
def test_consumer_output_ignores_stale_cache_content(tiny_dir, producer, fault):
    extra = {} if fault is None else {"test_fault": fault, "transfer_timeout": 0.5}
    consumer = _engine(tiny_dir, "kv_consumer", **extra)
    try:
        runner = consumer.worker.runner
        for plane in [*runner.kv_caches, *runner.index_caches]:
            if plane is not None:
                plane.fill_(float("nan"))
        _, ids = producer.encode_prompt(long_prompt(21))
        salt = uuid.uuid4().hex             # no prefix hit from another parametrization
        want = _run(producer, EngineCoreRequest(f"ref-{salt}", ids, _greedy(12), None, time.time(),
                                                cache_salt=salt))
        _, _, params = _run(producer, EngineCoreRequest(
            f"prefill-{salt}", ids, _greedy(1), None, time.time(), cache_salt=salt,
            kv_transfer_params=KVTransferParams(do_remote_decode=True)))
        got = _run(consumer, EngineCoreRequest(f"decode-{salt}", ids, _greedy(12), None, time.time(),
                                               kv_transfer_params=parse_kv_transfer_params(params)))
        stats = consumer.core.scheduler.connector.stats
        assert (stats.pulls_done, stats.fallbacks) == ((1, 0) if fault is None else (0, 1))
        assert got[0] == want[0]
        assert got[1] == want[1]            # logprobs too: not one bit differs
    finally:
        consumer.shutdown()
