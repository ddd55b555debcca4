"""The tiny model through the `LLM` API at TP 2 and 4, EP 2 and 4, and DP 2 + EP 2, each a set
of gloo CPU processes: the same tokens as one in-process rank for a chunked, preempted batch
with seeded sampling and a prefix hit; rank processes laid out as the flags say; every rank
clean afterwards. A killed rank ends the engine with an error that names it."""
import threading
import time

import pytest

from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams
from workload import LAYOUTS, assert_no_near_ties, check_ranks, engine_flags, layout_sizes, run


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm = LLM(str(tiny_dir), **engine_flags())
    out = run(llm)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_no_near_ties(llm)
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_rank(tiny_dir, reference, name):
    flags = LAYOUTS[name]
    tp, dp, blocks = layout_sizes(flags)
    llm = LLM(str(tiny_dir), **engine_flags(tp, blocks), **flags)
    try:
        assert llm.engine.core is None          # the engine runs in its own processes
        assert run(llm) == reference
        states = llm.engine.engine_states()
        check_ranks(states, tp, dp, flags.get("enable_expert_parallel", False))
        assert sum(s.num_preemptions for s in states) > 0
        assert sum(s.prefix_cache_hits for s in states) >= 32
    finally:
        llm.shutdown()


def test_mp_backend_at_one_rank(tiny_dir, reference):
    """`distributed_executor_backend="mp"` runs even one rank as an engine process."""
    llm = LLM(str(tiny_dir), distributed_executor_backend="mp", **engine_flags())
    try:
        assert llm.engine.core is None
        assert run(llm) == reference
        # admissions are pipelined: a refused request in a batch still raises, nothing stays
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            too_long = [7] * (llm.engine.model_config.max_position_embeddings + 1)
            llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": too_long}],
                         SamplingParams(max_tokens=4), use_tqdm=False)
        check_ranks(llm.engine.engine_states(), 1, 1, False)
    finally:
        llm.shutdown()


def test_killed_rank_is_named_and_ends_the_engine(tiny_dir):
    import os
    import signal

    from m3serve.engine.errors import EngineDeadError

    llm = LLM(str(tiny_dir), tensor_parallel_size=2, dtype="float32")
    follower = next(r for r in llm.engine.engine_states()[0].ranks if r["rank"] == 1)["pid"]
    threading.Timer(2.0, os.kill, (follower, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                     SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 20
    with pytest.raises(EngineDeadError):
        llm.generate(["again"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.client.engines is None     # every engine process is gone


def test_frozen_rank_is_named_and_ends_the_engine(tiny_dir):
    """A rank that stops (SIGSTOP: alive, but it never answers again) misses its heartbeats."""
    import os
    import signal

    from m3serve.engine.errors import EngineDeadError

    llm = LLM(str(tiny_dir), tensor_parallel_size=2, dtype="float32")
    follower = next(r for r in llm.engine.engine_states()[0].ranks if r["rank"] == 1)["pid"]
    threading.Timer(1.0, os.kill, (follower, signal.SIGSTOP)).start()
    start = time.monotonic()
    try:
        with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) stopped responding"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                         SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        try:
            os.kill(follower, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_async_scheduling_at_tp2_equals_one_rank(tiny_dir, reference):
    """--async-scheduling across rank processes: every rank takes the in-flight tokens from its
    own device, and the result is still the one rank's, token for token."""
    llm = LLM(str(tiny_dir), tensor_parallel_size=2, **{**engine_flags(2), "async_scheduling": True})
    try:
        assert run(llm) == reference
        [state] = llm.engine.engine_states()
        assert state.num_deferred_steps > 10 and state.integrity_error is None
        check_ranks([state], 2, 1, False)
    finally:
        llm.shutdown()
