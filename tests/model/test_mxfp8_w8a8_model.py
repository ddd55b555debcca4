"""The W8A8 opt-in (M3SERVE_MXFP8_W8A8) through the whole engine: the tiny MXFP8 checkpoint
served by `LLM` with a 300-token prompt (one prefill step of >= 256 rows) takes the FP8
activation path in its MXFP8 linears when opted in and not otherwise, and the outputs change
with it (different numerics; the tiny random model is too sensitive to bound by how much)."""
import torch

from m3serve import envs
from m3serve.layers import dispatch
from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams


def _first_logprob(llm, prompt):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids[0], out.logprobs[0][out.token_ids[0]].logprob


def test_opt_in_reaches_the_mxfp8_linears(quant_dir, monkeypatch):
    prompt = torch.randint(0, 2000, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(model=str(quant_dir("mxfp8")), dtype="float32", max_num_batched_tokens=512,
              enable_prefix_caching=False)
    key = ("packed_linear_w8a8", "reference")
    monkeypatch.setattr(envs, "MXFP8_W8A8", False)
    before = dispatch.executed[key]
    token_off, lp_off = _first_logprob(llm, prompt)
    assert dispatch.executed[key] == before
    monkeypatch.setattr(envs, "MXFP8_W8A8", True)
    token_on, lp_on = _first_logprob(llm, prompt)
    assert dispatch.executed[key] > before          # the prefill step's MXFP8 linears
    assert (token_on, lp_on) != (token_off, lp_off)
    after = dispatch.executed[key]
    _first_logprob(llm, prompt[:200])                  # a step of 200 rows: weight-only
    assert dispatch.executed[key] == after
