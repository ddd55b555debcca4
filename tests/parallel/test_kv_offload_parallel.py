"""The CPU tier at TP 2 (gloo CPU processes): each rank copies its own shard of every block out
and back, the scheduler sending one set of slots to both; the sessions of
tests/model/test_kv_offload_engine.py give the tokens one in-process rank gives without a tier,
prefixes come back from the tier, and every rank ends clean."""
import time

from refgreedy import assert_engine_no_near_ties
from test_kv_offload_engine import POOL, sessions

from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams

TP2_BYTES_PER_TOKEN = 5 * 2 * 1 * 32 * 4 + 3 * 32 * 4      # one of the two KV heads per rank


def test_tp2_tier_equals_one_rank_without_tier(tiny_dir):
    one = []
    want = sessions(LLM(str(tiny_dir), **POOL), record=one,
                    params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    # TP 2 rounds the float32 logits differently from one rank (the chosen tokens' logprobs
    # differed by < 2e-6 here): no greedy step of the reference may lead its runner-up by less
    # than 1e-4, so that rounding can never flip the comparison below (these sessions' closest
    # step leads by 8.7e-4)
    assert_engine_no_near_ties(one, margin=1e-4)
    per_rank = 64 * 16 * TP2_BYTES_PER_TOKEN           # 64 blocks of each rank's shard ...
    llm = LLM(str(tiny_dir), tensor_parallel_size=2, **{**POOL, "kv_cache_memory": 14 * 16 * TP2_BYTES_PER_TOKEN},
              kv_offloading_size=2 * per_rank / (1 << 30))          # ... the size counts both ranks
    try:
        assert sessions(llm) == want
        deadline = time.monotonic() + 30
        while True:          # the engine process finishes the last stores on its own
            (state,) = llm.engine.engine_states()
            if state.num_offload_refs == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert state.external_prefix_cache_hits > 0
        assert state.integrity_error is None and state.num_offload_refs == 0
        assert state.num_free_blocks == state.num_usable_blocks
        assert [r["num_cpu_blocks"] for r in state.ranks] == [64, 64]
    finally:
        llm.shutdown()
