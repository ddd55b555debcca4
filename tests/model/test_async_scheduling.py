"""--async-scheduling on the tiny model: the same tokens and finish reasons as one step after
another, for greedy and seeded sampled requests that stop on tokens, on max_tokens (1 included)
and on the context, beside requests that cannot be deferred (logprobs, penalties), with n > 1,
under chunking and a pool too small for everyone; steps really were deferred; aborts in flight
free every block."""
import random

import pytest

from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams


def workload(seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 2000) for _ in range(rng.randrange(3, 200))] for _ in range(16)]
    params = []
    for i in range(16):
        kind = i % 8
        if kind == 7:       # stop tokens masked until min_tokens: argmax alone only from then on
            params.append(SamplingParams(temperature=0, max_tokens=30, min_tokens=6,
                                         stop_token_ids=list(range(100, 900))))
        elif kind == 5:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=9, ignore_eos=True))
        elif kind == 6:
            params.append(SamplingParams(temperature=0, max_tokens=6, logprobs=2, n=2, ignore_eos=True))
        else:
            params.append(SamplingParams(
                temperature=0, max_tokens=[1, 2, 23, 40, 11][kind], ignore_eos=kind % 2 == 1,
                stop_token_ids=list(range(100, 300)) if kind == 2 else None))   # stops early
    return prompts, params


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def check_clean(llm):
    core = llm.engine.core
    assert not core.scheduler.has_unfinished_requests()
    assert core.integrity_error() is None
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_usable_blocks


@pytest.mark.parametrize("flags", [
    dict(max_num_seqs=6),
    dict(max_num_batched_tokens=48, max_num_seqs=6),
    dict(max_num_batched_tokens=64, kv_cache_memory=20 * 16 * 2944),    # too few blocks for all
    dict(max_num_seqs=6, max_model_len=160),                            # some stop at the context
], ids=["batched", "chunked", "tight-pool", "context"])
def test_async_equals_sync(tiny_dir, flags):
    prompts, params = workload()
    if "max_model_len" in flags:
        prompts = [p[:150] for p in prompts]
    want = generate(LLM(str(tiny_dir), dtype="float32", async_scheduling=False, **flags), prompts, params)
    llm = LLM(str(tiny_dir), dtype="float32", async_scheduling=True, **flags)
    assert generate(llm, prompts, params) == want
    assert llm.engine.core.scheduler.num_deferred_steps > 10
    check_clean(llm)


def test_sampled_steps_are_deferred_with_the_same_tokens(tiny_dir):
    """Seeded sampling (temperature, top-k, top-p, min-p, min_tokens) beside greedy requests:
    those steps are deferred too (one rank), with the tokens of steps in turn; a request whose
    sampling reads its history (a penalty) keeps its steps in turn."""
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 2000) for _ in range(rng.randrange(3, 120))] for _ in range(8)]
    params = [SamplingParams(temperature=0.8, top_k=20, seed=1, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.8, seed=2, max_tokens=18, ignore_eos=True),
              SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=4, max_tokens=20, min_tokens=4,
                             stop_token_ids=list(range(100, 900))),
              SamplingParams(temperature=0, max_tokens=22, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=1),
              SamplingParams(temperature=0.9, seed=6, max_tokens=12, ignore_eos=True, n=2),
              SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)]
    flags = dict(max_num_seqs=4, max_num_batched_tokens=64)
    want = generate(LLM(str(tiny_dir), dtype="float32", async_scheduling=False, **flags), prompts, params)
    llm = LLM(str(tiny_dir), dtype="float32", async_scheduling=True, **flags)
    assert generate(llm, prompts, params) == want
    assert llm.engine.core.scheduler.num_deferred_steps > 20
    check_clean(llm)
    penalised = [SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True, presence_penalty=0.5)]
    llm.engine.core.scheduler.num_deferred_steps = 0
    assert generate(llm, prompts[:1], penalised) == generate(
        LLM(str(tiny_dir), dtype="float32", async_scheduling=False, **flags), prompts[:1], penalised)
    assert llm.engine.core.scheduler.num_deferred_steps == 0


def test_in_flight_abort_frees_everything(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", async_scheduling=True, max_num_seqs=4)
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"r{i}", {"prompt_token_ids": [7 + i] * 20},
                        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(6):
        eng.step()
    assert eng.core._deferred is not None                   # a step is in flight
    eng.abort_request("r1")
    while eng.has_unfinished_requests():
        eng.step()
    eng.step()
    check_clean(llm)


def test_on_by_default_where_it_applies():
    """vLLM's rule: on unless turned off, speculative engines included (their plain steps are
    deferred); off beside DP > 1 (not combined yet), and asking for both is a clear error."""
    from m3serve.config import EngineConfig
    from m3serve.engine.engine_core import async_scheduling_applies

    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
    assert async_scheduling_applies(EngineConfig.from_kwargs())
    assert async_scheduling_applies(EngineConfig.from_kwargs(**spec))
    assert not async_scheduling_applies(EngineConfig.from_kwargs(async_scheduling=False))
    assert not async_scheduling_applies(EngineConfig.from_kwargs(data_parallel_size=2))
    with pytest.raises(ValueError, match="--async-scheduling cannot be combined with --data-parallel-size > 1"):
        EngineConfig.from_kwargs(async_scheduling=True, data_parallel_size=2)


def test_the_worker_samples_by_the_schedulers_mode(tiny_dir, monkeypatch):
    """A step's sampling mode is decided once, by the scheduler (`core/sampling_mode.py`), and
    the worker follows it without re-deriving it from the params: told ARGMAX, it takes the
    argmax of requests that ask for sampling; told FULL, greedy requests go through the whole
    sampler, and no step is deferred."""
    import m3serve.core.scheduler as scheduler_mod
    from m3serve.core.sampling_mode import SamplingMode

    llm = LLM(str(tiny_dir), dtype="float32", max_num_seqs=4)
    sched = llm.engine.core.scheduler
    prompts = workload()[0][:4]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=1.5, seed=3, max_tokens=8, ignore_eos=True)
    want = generate(llm, prompts, [greedy] * 4)
    assert generate(llm, prompts, [sampled] * 4) != want

    monkeypatch.setattr(scheduler_mod, "sampling_mode", lambda params, n: SamplingMode.ARGMAX)
    assert generate(llm, prompts, [sampled] * 4) == want

    calls = []
    sampler = llm.engine.worker.runner.step_sampler.sampler
    real = sampler.forward
    monkeypatch.setattr(sampler, "forward", lambda *args: calls.append(1) or real(*args))
    monkeypatch.setattr(scheduler_mod, "sampling_mode", lambda params, n: SamplingMode.FULL)
    deferred = sched.num_deferred_steps
    assert generate(llm, prompts, [greedy] * 4) == want
    assert len(calls) >= 8 and sched.num_deferred_steps == deferred
    check_clean(llm)
