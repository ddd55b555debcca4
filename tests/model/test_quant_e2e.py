"""End to end: each quantised tiny checkpoint served through `LLM` (chunked prefill, a batch,
a prefix-cache hit) gives, token for token, the greedy output of the dense reference
(`model/reference.py`) run on the checkpoint's dequantised weights; M3.1-Flash's all-MSA model
in its mixed MXFP8 + NVFP4 layout too."""
import pytest
import torch

from m3serve.llm import LLM
from m3serve.model.formats.layouts import dequantized_checkpoint
from m3serve.model.reference import ReferenceM3
from m3serve.sampling_params import SamplingParams

FORMATS = ("mxfp8", "nvfp4-modelopt", "nvfp4-ct", "mxfp4-quark")
MAX_TOKENS = 6


def prompts():
    """The second request (48 + 30 prompt tokens) outgrows the 4 selected blocks of 16, so the
    quantised index projections choose what its sparse layers attend to."""
    g = torch.Generator().manual_seed(11)
    shared, a, b, c = (torch.randint(0, 2000, (n,), generator=g).tolist() for n in (48, 9, 30, 37))
    return shared + a, shared + b, c


def serve(llm) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy tokens) for a batch of two, then a request whose first 48 tokens the
    batch cached."""
    first, second, other = prompts()
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": first}, {"prompt_token_ids": other}], greedy, use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": second}], greedy, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 48
    return [(first, batch[0].outputs[0].token_ids), (second, hit.outputs[0].token_ids)]


def assert_reference_greedy(weights: dict, cfg, served, margin: float = 1e-4) -> None:
    """Every served token is the reference's argmax given the tokens before it (one forward
    per sequence), and leads the runner-up by `margin` (ten times the ~1e-5 by which the
    engine's fp32 logits differ from the reference's here), so that rounding cannot flip it."""
    ref = ReferenceM3(cfg, weights)
    for prompt, tokens in served:
        logits, _ = ref.forward(torch.tensor(prompt + tokens[:-1]))
        steps = logits[len(prompt) - 1:]                                  # [MAX_TOKENS, V]
        top = steps.topk(2, dim=-1)
        assert top.indices[:, 0].tolist() == tokens
        assert (top.values[:, 0] - top.values[:, 1]).min() >= margin, "a near-tie: pick other prompts"


@pytest.mark.parametrize("fmt,flavor", [(f, "m3") for f in FORMATS] + [("mxfp8-nvfp4", "m3.1-flash")])
def test_greedy_equals_reference_on_dequantised_weights(quant_dir, fmt, flavor):
    path = quant_dir(fmt, flavor)
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=32, max_num_seqs=4)
    served = serve(llm)
    assert llm.engine.core.num_steps > 5          # the prompts were chunked
    assert_reference_greedy(dequantized_checkpoint(path), llm.engine.model_config, served)
