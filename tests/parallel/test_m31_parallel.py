"""MiniMax-M3.1-Flash's all-MSA tiny model at TP 2 (two gloo CPU processes): the greedy tokens of
a chunked batch with a prefix hit equal the dense reference's; each rank holds an index cache in
every layer (the index key is replicated, not split, over TP)."""
import sys
from pathlib import Path

import torch

from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from refgreedy import reference_greedy, reference_model  # noqa: E402


def test_tp2_greedy_equals_reference(tiny_m31_dir):
    g = torch.Generator().manual_seed(21)
    shared = torch.randint(0, 2000, (50,), generator=g).tolist()
    first = [shared + torch.randint(0, 2000, (n,), generator=g).tolist() for n in (14, 60)]
    again = shared + torch.randint(0, 2000, (9,), generator=g).tolist()
    ref = reference_model(tiny_m31_dir)
    want = [reference_greedy(ref, p, 6) for p in (*first, again)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tiny_m31_dir), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=32,
              async_scheduling=False)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in first], params, use_tqdm=False)
        hit = llm.generate([{"prompt_token_ids": again}], params, use_tqdm=False)[0]
        assert hit.num_cached_tokens == 48                      # 3 full blocks of 16 shared
        assert [o.outputs[0].token_ids for o in (*outs, hit)] == want
        [state] = llm.engine.engine_states()
        assert sorted(r["tp_rank"] for r in state.ranks) == [0, 1]
        assert all(r["index_cache_layers"] == [0, 1, 2, 3, 4] for r in state.ranks)
    finally:
        llm.shutdown()
