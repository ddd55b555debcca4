"""Speculative decoding with cross-layer top-k reuse in the target: verify rows (k + 1 query
tokens a request, each with its own selection, handed over per token to the skipping layers)
give the tokens plain decoding with reuse gives, with the MTP module (its own MSA layer always
runs its indexer) proposing the true continuation with planted mistakes, so long runs are
accepted, over a batch with chunked prefill and a prefix hit."""
import torch

from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams
from m3serve.distill.tiny_drafts import make_draft
from test_spec_engine import _check_clean, _oracle

REUSE = {"text_config": {"use_index_cache": True, "index_topk_freq": 2}}
FLAGS = dict(dtype="float32", max_num_batched_tokens=40, max_num_seqs=8, hf_overrides=REUSE)


def _prompts():
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 2000, (70,), generator=g).tolist()
    return [torch.randint(0, 2000, (n,), generator=g).tolist() for n in (150, 9, 100)] + [shared, shared + [7, 8, 9]]


def test_verify_rows_with_reuse_equal_plain_decoding(tiny_dir, tmp_path):
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(tiny_dir), **FLAGS)
    want = [o.outputs[0].token_ids for o in
            plain.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    draft = make_draft(tmp_path / "mtp", "mtp", tiny_dir, seed=5)
    llm = LLM(str(tiny_dir), speculative_config={"method": "mtp", "model": str(draft), "num_speculative_tokens": 3},
              **FLAGS)
    target = llm.engine.worker.model
    assert [a.computes_index for a in target.attention_layers] == [False, True, False, True, False]
    assert all(a.computes_index for a in llm.engine.worker.runner.proposer.drafter.draft.attention_layers)
    _oracle(llm, {tuple(p): p + ids for p, ids in zip(prompts, want)}, 3)
    got = [o.outputs[0].token_ids for o in
           llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    assert got == want
    sched = llm.engine.core.scheduler
    assert sched.spec_stats.num_drafts > 0 and sched.spec_stats.mean_acceptance_length > 2.0
    assert llm.engine.core.kv_manager.prefix_cache_hits >= 64
    _check_clean(llm)
