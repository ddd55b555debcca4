"""The CPU tier end to end on the tiny model: multi-turn sessions through a GPU pool too small
to keep them, with chunked prefill and preemption, give the tier-off tokens while their
prefixes come back from the tier; restored pages of both cache groups are bit-identical to the
evicted ones; a corrupted host copy of the index group alone changes the output (so it is
really restored); an abort during a restore frees everything."""
import pytest
import torch

from m3serve.core.request import RequestStatus
from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams

BYTES_PER_TOKEN = 5 * 2 * 2 * 32 * 4 + 3 * 32 * 4      # fp32 tiny model: main K/V + index keys
POOL = dict(dtype="float32", kv_cache_memory=14 * 16 * BYTES_PER_TOKEN, max_num_batched_tokens=32, max_num_seqs=4)
TIER = dict(kv_offloading_size=64 * 16 * BYTES_PER_TOKEN / (1 << 30))   # 64 blocks
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def ids(n, seed):
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sessions(llm, turns=3, params=GREEDY, record=None) -> list[list[int]]:
    """Three sessions, their turns sent together: each turn is the whole conversation so far
    plus 12 new tokens. Returns every turn's output tokens (and appends the RequestOutputs to
    `record` when given)."""
    convs = [ids(n, seed) for n, seed in ((80, 1), (96, 2), (110, 3))]
    out = []
    for turn in range(turns):
        outs = llm.generate([{"prompt_token_ids": c} for c in convs], params, use_tqdm=False)
        if record is not None:
            record += outs
        got = [o.outputs[0].token_ids for o in outs]
        out += got
        convs = [c + g + ids(12, 100 * turn + i) for i, (c, g) in enumerate(zip(convs, got))]
    return out


def drain(llm):
    """Finish the copies still in flight (they hold blocks) and check the books."""
    core = llm.engine.core
    while core.has_unfinished_requests():
        core.step()
    core.scheduler.check_integrity()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_usable_blocks
    if core.kv_manager.offload is not None:
        assert core.kv_manager.offload.references() == ({}, {})


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm = LLM(str(tiny_dir), **POOL)
    return sessions(llm)


def test_sessions_equal_tier_off_across_evictions(tiny_dir, reference):
    llm = LLM(str(tiny_dir), **POOL, **TIER)
    assert sessions(llm) == reference
    core = llm.engine.core
    stats = core.kv_manager.offload.stats
    assert core.scheduler.num_kv_loads > 0 and stats.hits > 0 and stats.blocks_to_gpu > 0
    assert core.kv_manager.prefix_cache_queries == stats.queries      # one denominator for both tiers
    drain(llm)


def _pages(runner, block_id):
    main = [kv[:, block_id].clone() for kv in runner.kv_caches]
    index = [ix[block_id].clone() for ix in runner.index_caches if ix is not None]
    return main, index


def test_restored_pages_are_bit_identical_in_both_groups(tiny_dir):
    llm = LLM(str(tiny_dir), **POOL, **TIER)
    core, runner = llm.engine.core, llm.engine.worker.runner
    pool = core.kv_manager.block_pool
    first = ids(100, 7)
    llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
    drain(llm)
    hashes = list(pool._cached)
    assert len(hashes) == 6                      # 100 prompt + 7 computed tokens: 6 full blocks
    before = {h: _pages(runner, pool._cached[h].block_id) for h in hashes}
    llm.generate([{"prompt_token_ids": ids(120, 8)}, {"prompt_token_ids": ids(90, 9)}], GREEDY, use_tqdm=False)
    drain(llm)
    assert not any(h in pool._cached for h in hashes)       # evicted from the GPU pool
    llm.generate([{"prompt_token_ids": first + ids(12, 10)}], GREEDY, use_tqdm=False)
    drain(llm)
    assert core.scheduler.num_kv_loads == 1
    for h in hashes:
        main, index = _pages(runner, pool._cached[h].block_id)
        assert all(torch.equal(a, b) for a, b in zip(main, before[h][0]))
        assert all(torch.equal(a, b) for a, b in zip(index, before[h][1]))
        assert len(index) == 3


def _restore_turn(llm, corrupt=None):
    """Turn 2 of a session whose turn 1 was evicted to the tier; `corrupt(offload, slots)` may
    change the host copy first. Returns the turn's tokens and logprobs."""
    first = ids(100, 11)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    out = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)[0].outputs[0]
    llm.generate([{"prompt_token_ids": ids(120, 12)}, {"prompt_token_ids": ids(90, 13)}], GREEDY, use_tqdm=False)
    drain(llm)
    core = llm.engine.core
    if corrupt is not None:
        offload = core.kv_manager.offload
        slots = sorted(offload.tier._by_hash[h] for h in list(offload.tier._by_hash)
                       if h not in core.kv_manager.block_pool._cached)
        corrupt(llm.engine.worker.cpu_tier, slots)
    second = first + out.token_ids + ids(12, 14)
    got = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0].outputs[0]
    assert core.scheduler.num_kv_loads == (core.kv_manager.offload is not None)
    drain(llm)
    return got.token_ids, [{k: v.logprob for k, v in pos.items()} for pos in got.logprobs]


def test_a_corrupted_index_copy_changes_the_output(tiny_dir):
    """If the index group were not restored (or restored from the wrong place), the sparse
    layers would pick other blocks: negating the host copy of the index keys alone must show."""
    def negate_index(offload, slots):
        for i, group in enumerate(offload.groups):
            if group == "index":
                offload.host_planes[i].view(torch.float32)[slots] *= -1

    cold = LLM(str(tiny_dir), **POOL)
    want = _restore_turn(cold)
    assert _restore_turn(LLM(str(tiny_dir), **POOL, **TIER)) == want
    assert _restore_turn(LLM(str(tiny_dir), **POOL, **TIER), negate_index) != want


def test_abort_during_restore_frees_everything(tiny_dir):
    llm = LLM(str(tiny_dir), **POOL, **TIER)
    engine, core = llm.engine, llm.engine.core
    first = ids(100, 21)
    llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
    llm.generate([{"prompt_token_ids": ids(120, 22)}, {"prompt_token_ids": ids(90, 23)}], GREEDY, use_tqdm=False)
    drain(llm)
    engine.add_request("turn2", {"prompt_token_ids": first + ids(12, 24)}, GREEDY.clone())
    engine.settle()
    so = core.scheduler.schedule()
    (rid, (request, _, _)), = core.scheduler.kv_waiting.items()
    assert request.status == RequestStatus.WAITING_FOR_KV and len(so.kv_connector_metadata["cpu_tier"].load_slots) == 6
    loading_blocks = set(core.kv_manager.get_block_ids(rid))
    engine.abort_request("turn2")
    assert set(core.kv_manager.get_block_ids(rid)) == loading_blocks    # held until the copy is over
    assert not loading_blocks & set(core.kv_manager.block_pool._free_queue)
    core.execute(so)                              # the copy lands and is reported: now they go
    assert not core.scheduler.kv_waiting and not core.kv_manager.has_blocks(rid)
    drain(llm)
    # the tier still serves the prefix afterwards
    again = llm.generate([{"prompt_token_ids": first + ids(12, 24)}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 96 and core.scheduler.num_kv_loads == 2
    drain(llm)
