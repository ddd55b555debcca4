"""The CPU tier on a GPU (`pytest -m gpu tests/model/test_kv_offload_gpu.py`, in its own process
for TRITON_F32_DEFAULT below): pinned host slots, copies on a side stream ordered by events,
with CUDA graphs and async scheduling on. Multi-turn sessions give the tier-off tokens, and the
restored pages of both cache groups are bit-identical to the evicted ones."""
import os

import pytest
import torch

# fp32 tl.dot defaults to TF32 on Hopper; restored and recomputed prefixes should round alike.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

pytestmark = pytest.mark.gpu


def test_sessions_tier_on_equal_off_on_cuda(tiny_dir):
    from test_kv_offload_engine import POOL, TIER, drain, sessions

    from m3serve.llm import LLM

    flags = dict(POOL, device="cuda")
    want = sessions(LLM(str(tiny_dir), **flags))
    llm = LLM(str(tiny_dir), **flags, **TIER)
    assert sessions(llm) == want
    drain(llm)
    offload = llm.engine.worker.cpu_tier
    assert offload.stream is not None and all(p.is_pinned() for p in offload.host_planes)
    stats = llm.engine.core.kv_manager.offload.stats
    assert llm.engine.core.scheduler.num_kv_loads > 0 and stats.hits > 0
    assert stats.seconds_to_cpu > 0 and stats.seconds_to_gpu > 0      # timed by the side stream's events
    assert llm.engine.worker.runner.num_graph_steps > 0


def test_restored_pages_bit_identical_on_cuda(tiny_dir):
    from test_kv_offload_engine import GREEDY, POOL, TIER, _pages, drain, ids

    from m3serve.llm import LLM

    llm = LLM(str(tiny_dir), **POOL, **TIER, device="cuda")
    core, runner = llm.engine.core, llm.engine.worker.runner
    pool = core.kv_manager.block_pool
    first = ids(100, 7)
    llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
    drain(llm)
    hashes = list(pool._cached)
    before = {h: _pages(runner, pool._cached[h].block_id) for h in hashes}
    llm.generate([{"prompt_token_ids": ids(120, 8)}, {"prompt_token_ids": ids(90, 9)}], GREEDY, use_tqdm=False)
    drain(llm)
    assert not any(h in pool._cached for h in hashes)
    llm.generate([{"prompt_token_ids": first + ids(12, 10)}], GREEDY, use_tqdm=False)
    drain(llm)
    assert core.scheduler.num_kv_loads == 1
    for h in hashes:
        main, index = _pages(runner, pool._cached[h].block_id)
        assert all(torch.equal(a, b) for a, b in zip(main, before[h][0]))
        assert all(torch.equal(a, b) for a, b in zip(index, before[h][1]))
