"""The engine end to end on the tiny model: greedy outputs equal transformers' under batching,
chunked prefill and preemption; a request alone or batched bit for bit; prefix caching;
sampling; stop strings; logprobs; abort.
Every test ends with the KV integrity check (all blocks back in the pool)."""
import pytest
import torch

from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams

PROMPT_LENS = (5, 37, 80, 150, 9, 120)


def prompts(lens=PROMPT_LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2000, (n,), generator=g).tolist() for n in lens]


def assert_all_blocks_free(llm: LLM):
    core = llm.engine.core
    assert not core.scheduler.has_unfinished_requests()
    core.scheduler.check_integrity()
    core.kv_manager.check_integrity()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_usable_blocks
    assert llm.engine.states == {}


@pytest.fixture(scope="module")
def hf_greedy(hf_checkpoints):
    hf, _, _ = hf_checkpoints
    cache = {}

    def get(ids, n):
        key = (tuple(ids), n)
        if key not in cache:
            with torch.no_grad():
                cache[key] = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                         eos_token_id=None, pad_token_id=2047)[0, len(ids):].tolist()
        return cache[key]
    return get


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("flags", [
    dict(),                                                         # roomy: everything batched
    dict(max_num_batched_tokens=24),                                # chunked prefill
    # tight pool: preemption (one step after another: async scheduling preempts only when no
    # token is in flight, tests/model/test_async_scheduling.py)
    dict(max_num_batched_tokens=64, kv_cache_memory=14 * 16 * 2944, async_scheduling=False),
], ids=["batched", "chunked", "preempt"])
def test_greedy_equals_transformers(hf_checkpoints, hf_greedy, flags):
    _, hf_dir, _ = hf_checkpoints
    llm = LLM(model=str(hf_dir), dtype="float32", **flags)
    ps = prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == hf_greedy(p, 12)
        assert o.outputs[0].finish_reason == "length"
    if "kv_cache_memory" in flags:
        assert llm.engine.worker.num_blocks == 14
        assert llm.engine.core.scheduler.num_preemptions > 0
    if flags.get("max_num_batched_tokens") == 24:
        assert llm.engine.core.num_steps > sum(PROMPT_LENS) // 24
    assert_all_blocks_free(llm)


def test_prefix_cache_hit_is_bit_identical(tiny_dir):
    shared = prompts((100,), seed=3)[0]
    tail_a, tail_b = prompts((20, 30), seed=4)
    cold = LLM(model=str(tiny_dir), dtype="float32", enable_prefix_caching=False)
    warm = LLM(model=str(tiny_dir), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    ref = cold.generate([{"prompt_token_ids": shared + tail_b}], params, use_tqdm=False)[0]
    warm.generate([{"prompt_token_ids": shared + tail_a}], params, use_tqdm=False)
    hits_before = warm.engine.core.kv_manager.prefix_cache_hits
    hit = warm.generate([{"prompt_token_ids": shared + tail_b}], params, use_tqdm=False)[0]
    assert warm.engine.core.kv_manager.prefix_cache_hits - hits_before == 96   # 6 full blocks of 16
    assert hit.num_cached_tokens == 96
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids
    for a, b in zip(hit.outputs[0].logprobs, ref.outputs[0].logprobs):
        assert {k: v.logprob for k, v in a.items()} == {k: v.logprob for k, v in b.items()}
    assert_all_blocks_free(warm)
    assert_all_blocks_free(cold)


def test_seeded_sampling_reproducible_and_batch_independent(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32")
    p = {"prompt_token_ids": prompts((40,), seed=9)[0]}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([p], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in prompts((30, 60), seed=10)]
    batched = llm.generate([others[0], p, others[1]],
                           [SamplingParams(temperature=1.0, max_tokens=16), seeded,
                            SamplingParams(temperature=0.7, max_tokens=5)], use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone
    different = llm.generate([p], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16,
                                                 ignore_eos=True), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone
    assert_all_blocks_free(llm)


def test_a_request_computes_the_same_alone_and_batched(tiny_dir):
    """In float32 every last bit of the model reaches the logprobs: a prompt computed alone and
    beside other requests (prefilled in one step with them, then decoded in batches of three)
    gets the same logprobs bit for bit, whatever the thread count splits: alone on 1 thread
    (nothing split), alone on 4 (two servers or TP ranks can run different thread counts) and
    batched on 2. (A CPU op whose result for a row depends on the rows beside it or on where
    the threads split the tensor, like torch's fp32 sigmoid in the router and in SwiGLU, fails
    this; in bf16 such an ulp can flip a greedy token of the tiny model, so P/D, router and TP
    tests could see two servers disagree.)"""
    llm = LLM(model=str(tiny_dir), dtype="float32", enable_prefix_caching=False)
    p = {"prompt_token_ids": prompts((367,), seed=11)[0]}
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    others = [{"prompt_token_ids": q} for q in prompts((369, 30), seed=12)]
    threads = torch.get_num_threads()
    try:                               # tensors over torch's grain are split at thread-dependent places
        torch.set_num_threads(1)
        alone = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        torch.set_num_threads(4)
        alone4 = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        torch.set_num_threads(2)
        batched = llm.generate([others[0], p, others[1]], params, use_tqdm=False)[1].outputs[0]
    finally:
        torch.set_num_threads(threads)
    for other in (alone4, batched):
        assert other.token_ids == alone.token_ids
        for step, (a, b) in enumerate(zip(alone.logprobs, other.logprobs)):
            assert {k: v.logprob for k, v in a.items()} == {k: v.logprob for k, v in b.items()}, step
    assert_all_blocks_free(llm)


def test_stop_string_n_and_logprobs(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32")
    prompt = {"prompt_token_ids": prompts((50,), seed=12)[0]}
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    assert stop.strip() and stop in full.text
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    assert len(cut.token_ids) < len(full.token_ids)

    many = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=2,
                                                 prompt_logprobs=1), use_tqdm=False)[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1
    for c in many.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, pos in zip(c.token_ids, c.logprobs):
            assert tok in pos and len(pos) <= 3
        assert abs(c.cumulative_logprob - sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs))) < 1e-4
    assert many.prompt_logprobs[0] is None and len(many.prompt_logprobs) == 50
    assert_all_blocks_free(llm)


def test_prompt_logprobs_match_reference_logits(tiny_dir):
    from m3serve.model.reference import ReferenceM3
    from refgreedy import canonical_weights
    llm = LLM(model=str(tiny_dir), dtype="float32", max_num_batched_tokens=32)  # chunked
    ids = prompts((70,), seed=13)[0]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    ref_logits, _ = ReferenceM3(llm.engine.model_config, canonical_weights(tiny_dir)).forward(torch.tensor(ids))
    ref = ref_logits.log_softmax(-1)
    for p in range(1, 70):
        got = out.prompt_logprobs[p][ids[p]].logprob
        assert abs(got - ref[p - 1, ids[p]].item()) < 1e-3
    assert_all_blocks_free(llm)


def test_abort_any_time_frees_blocks(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32", max_num_batched_tokens=32)
    eng = llm.engine
    ps = prompts((100, 10, 60), seed=14)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("waiting", {"prompt_token_ids": ps[0]}, SamplingParams(max_tokens=5))
    eng.step()                       # r0 mid-prefill (100 tokens > 32 budget)
    eng.abort_request("waiting")     # never scheduled
    eng.abort_request("r0")          # mid-prefill
    for _ in range(6):
        eng.step()
    eng.abort_request("r1")          # decoding
    while eng.has_unfinished_requests():
        eng.step()
        eng.abort_request("r2")
    assert_all_blocks_free(llm)


def test_bad_requests_are_rejected_cleanly(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": list(range(70))}], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 2, 999999]}], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    ok = llm.generate(["fine"], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(ok.outputs[0].token_ids) >= 1
    assert_all_blocks_free(llm)
    with pytest.raises(ValueError, match="block_size 128 must equal"):
        LLM(model=str(tiny_dir), block_size=128)
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(model=str(tiny_dir), max_num_sequences=3)
