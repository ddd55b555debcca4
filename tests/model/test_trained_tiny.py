"""The embedded tiny model is trained (`scripts/train_tiny.py`, docs/tiny_model.md): on the held-out
text shipped beside it, its perplexity is at most a fifth of the random `make-tiny` model's, and
the engine's perplexity equals the dense reference's on the same weights, so that a numerical
change that moves the model fails here."""
import math

import pytest
import torch

from m3serve.llm import LLM
from m3serve.model.config import load_config
from m3serve.model.files import default_model_dir, load_tokenizer
from m3serve.model.reference import ReferenceM3
from m3serve.sampling_params import SamplingParams
from refgreedy import canonical_weights

WINDOW = 256          # tokens per scored window: 16 blocks, sparse selection at work past 64


def heldout_windows(num: int) -> list[list[int]]:
    """`num` windows of WINDOW tokens spread evenly over the shipped held-out text (code files,
    then docs sections)."""
    text = (default_model_dir() / "heldout.txt").read_text(encoding="utf-8")
    ids = load_tokenizer(default_model_dir()).encode(text, add_special_tokens=False).ids
    step = (len(ids) - WINDOW) // (num - 1)
    return [ids[i * step:i * step + WINDOW] for i in range(num)]


def engine_logprobs(model_dir, windows: list[list[int]], dtype: str) -> list[torch.Tensor]:
    """Per window, the engine's log-probability of tokens 1 .. WINDOW - 1 (prompt_logprobs)."""
    llm = LLM(model=str(model_dir), dtype=dtype)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], SamplingParams(max_tokens=1, prompt_logprobs=1),
                        use_tqdm=False)
    return [torch.tensor([o.prompt_logprobs[p][w[p]].logprob for p in range(1, len(w))])
            for o, w in zip(outs, windows)]


def perplexity(logprobs: list[torch.Tensor]) -> float:
    return math.exp(-torch.cat(logprobs).double().mean().item())


@pytest.fixture(scope="module")
def trained_fp32():
    windows = heldout_windows(8)
    return windows, engine_logprobs(default_model_dir(), windows, "float32")


def test_engine_perplexity_equals_the_reference(trained_fp32):
    windows, engine = trained_fp32
    ref = ReferenceM3(load_config(default_model_dir()), canonical_weights(default_model_dir()))
    want = []
    for w in windows[::4]:
        logits, _ = ref.forward(torch.tensor(w))
        want.append(logits.log_softmax(-1)[:-1].gather(1, torch.tensor(w[1:])[:, None])[:, 0])
    got = engine[::4]
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 2e-4
    ours, theirs = perplexity(got), perplexity(want)
    print(f"held-out perplexity over {2 * (WINDOW - 1)} tokens: engine {ours:.5f}, reference {theirs:.5f}")
    assert abs(ours - theirs) <= 1e-5 * theirs


def test_trained_perplexity_is_at_most_a_fifth_of_the_random_models(trained_fp32, tiny_dir):
    windows, trained = trained_fp32
    random = engine_logprobs(tiny_dir, windows, "float32")
    ours, theirs = perplexity(trained), perplexity(random)
    print(f"held-out perplexity over {len(windows) * (WINDOW - 1)} tokens: trained {ours:.2f}, random {theirs:.1f}")
    assert ours <= theirs / 5


def test_the_default_dtype_serves_the_same_model(trained_fp32):
    """The default (bf16) engine on the shipped weights: within a few percent of fp32's perplexity."""
    windows, fp32 = trained_fp32
    default = engine_logprobs(default_model_dir(), windows, "auto")
    assert abs(perplexity(default) / perplexity(fp32) - 1) < 0.05
