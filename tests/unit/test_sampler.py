"""Sampler: greedy, seeded reproducibility, sampling distributions, penalties, logprobs."""
import math

import pytest
import torch

from m3serve.sampling_params import SamplingParams
from m3serve.worker.sampler import (
    Sampler, SamplingMetadata, apply_penalties, compute_logprobs, make_generator,
)

# Chi-square critical values at p = 0.001, indexed by degrees of freedom.
_CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _metadata(params, vocab, outputs=None, prompts=None, generators=None):
    n = len(params)
    if generators is None:
        generators = [make_generator(p.seed, "cpu") if p.seed is not None else None
                      for p in params]
    return SamplingMetadata.from_params(
        params, outputs or [[] for _ in range(n)], prompts or [[] for _ in range(n)],
        generators, vocab, "cpu")


def test_greedy_is_argmax_and_mixed_batch_keeps_greedy_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0)] * 6
    out = Sampler()(logits, _metadata(params, 50))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None

    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)] * 3
    out = Sampler()(logits, _metadata(mixed, 50))
    assert torch.equal(out.sampled_token_ids[0::2], logits[0::2].argmax(-1))


def test_input_logits_not_modified():
    logits = torch.randn(2, 30)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, top_k=3, top_p=0.5,
                             min_p=0.1, seed=3, logprobs=2, min_tokens=2, stop_token_ids=[1])] * 2
    Sampler()(logits, _metadata(params, 30, outputs=[[1, 2], [3]], prompts=[[4], [5]]))
    assert torch.equal(logits, before)


def _run_steps(sampler, logits_per_step, params, row, num_steps):
    """Sample `num_steps` steps; the seeded request sits at `row`; returns its tokens."""
    generators = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
    tokens = []
    for step in range(num_steps):
        meta = SamplingMetadata.from_params(params, [[] for _ in params], [[] for _ in params],
                                            generators, logits_per_step.shape[-1], "cpu")
        logits = logits_per_step[step].expand(len(params), -1)
        tokens.append(int(sampler(logits, meta).sampled_token_ids[row]))
    return tokens


def test_seeded_request_same_tokens_alone_and_batched():
    torch.manual_seed(0)
    vocab, steps = 64, 8
    logits_per_step = torch.randn(steps, vocab)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = _run_steps(Sampler(), logits_per_step, [seeded], 0, steps)

    neighbours = [SamplingParams(temperature=0.7, seed=99), SamplingParams(temperature=0.0),
                  SamplingParams(temperature=1.3, top_k=5)]
    for row in range(4):
        params = neighbours[:row] + [seeded] + neighbours[row:]
        sampler = Sampler(generator=torch.Generator().manual_seed(row))
        assert _run_steps(sampler, logits_per_step, params, row, steps) == alone

    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    assert _run_steps(Sampler(), logits_per_step, [other_seed], 0, steps) != alone


def test_greedy_row_does_not_advance_its_generator():
    generator = make_generator(5, "cpu")
    state = generator.get_state()
    meta = _metadata([SamplingParams(temperature=0.0, seed=5)], 10, generators=[generator])
    Sampler()(torch.randn(1, 10), meta)
    assert torch.equal(generator.get_state(), state)


def test_seed_without_generator_is_rejected():
    with pytest.raises(ValueError, match="seed=7"):
        _metadata([SamplingParams(seed=7)], 10, generators=[None])


# Probabilities placed at shuffled ids so "best first" is not just "lowest id first".
_PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02])
_IDS = torch.tensor([3, 6, 0, 5, 1, 4, 2])
_NUM_DRAWS = 4000


def _draw(params):
    vocab = len(_PROBS)
    logits = torch.empty(vocab)
    logits[_IDS] = _PROBS.log() + 0.7  # an offset: logits are not normalised log-probs
    batch = [params] * _NUM_DRAWS
    sampler = Sampler(generator=torch.Generator().manual_seed(0))
    tokens = sampler(logits.expand(_NUM_DRAWS, -1), _metadata(batch, vocab)).sampled_token_ids
    return torch.bincount(tokens, minlength=vocab).double()


def _assert_distribution(counts, expected_by_rank):
    """expected_by_rank[r] = probability of the r-th best token; zeros must never be drawn."""
    expected = torch.zeros(len(_PROBS), dtype=torch.float64)
    expected[_IDS] = torch.tensor(expected_by_rank, dtype=torch.float64)
    expected = expected / expected.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew outside the support: {counts}"
    exp_counts = expected[support] * _NUM_DRAWS
    if int(support.sum()) == 1:
        return  # a single-token support is fully checked by the line above
    chi2 = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    assert chi2 < _CHI2_CRIT[int(support.sum()) - 1], (chi2, counts, exp_counts)


@pytest.mark.parametrize("kwargs,expected_by_rank", [
    (dict(temperature=1.0), [0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02]),
    # Temperature 0.5 squares the probabilities before renormalising.
    (dict(temperature=0.5), [p * p for p in [0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02]]),
    (dict(top_k=2), [0.40, 0.25, 0, 0, 0, 0, 0]),
    (dict(top_k=100), [0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02]),
    # Nucleus 0.7: 0.40 + 0.25 = 0.65 < 0.7, so the third token is still needed.
    (dict(top_p=0.7), [0.40, 0.25, 0.15, 0, 0, 0, 0]),
    (dict(top_p=0.6), [0.40, 0.25, 0, 0, 0, 0, 0]),
    (dict(top_p=0.3), [1.0, 0, 0, 0, 0, 0, 0]),
    # min_p 0.3 keeps p >= 0.12; min_p 0.2 keeps p >= 0.08.
    (dict(min_p=0.3), [0.40, 0.25, 0.15, 0, 0, 0, 0]),
    (dict(min_p=0.2), [0.40, 0.25, 0.15, 0.10, 0, 0, 0]),
    # top_k 4 then top_p 0.8 of the renormalised {.4,.25,.15,.1}/.9: .444+.278 < .8 -> 3 kept.
    (dict(top_k=4, top_p=0.8), [0.40, 0.25, 0.15, 0, 0, 0, 0]),
])
def test_sampling_distribution(kwargs, expected_by_rank):
    _assert_distribution(_draw(SamplingParams(**kwargs)), expected_by_rank)


def test_distribution_check_rejects_wrong_distribution():
    # Guards the statistical helper itself: plain sampling is not the top-k distribution.
    with pytest.raises(AssertionError):
        _assert_distribution(_draw(SamplingParams()), [0.40, 0.25, 0.15, 0, 0, 0, 0])
    with pytest.raises(AssertionError):
        _assert_distribution(_draw(SamplingParams()), [0.5, 0.2, 0.15, 0.05, 0.05, 0.03, 0.02])


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams()]
    meta = _metadata(params, 5, outputs=[[1, 1, 3], [1, 3]], prompts=[[0], [0]])
    got = apply_penalties(logits, meta.penalties)
    # token 0: prompt only -> repetition only: 2 / 2.
    # token 1: output x2, negative -> -1 * 2, then - 0.5 * 2 - 0.25.
    # token 3: output x1, positive -> 3 / 2, then - 0.5 - 0.25.
    expected = torch.tensor([[1.0, -3.25, 0.5, 0.75, -2.0],
                             [2.0, -1.0, 0.5, 3.0, -2.0]])
    assert torch.equal(got, expected)


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[1.0, 3.0, 2.5]])
    plain = Sampler()(logits, _metadata([SamplingParams(temperature=0)], 3, outputs=[[1]]))
    penalised = SamplingParams(temperature=0, frequency_penalty=1.0)
    out = Sampler()(logits, _metadata([penalised], 3, outputs=[[1]]))
    assert int(plain.sampled_token_ids[0]) == 1
    assert int(out.sampled_token_ids[0]) == 2


def test_min_tokens_blocks_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    params.add_eos_token_ids([3])
    early = Sampler()(logits, _metadata([params], 4, outputs=[[2]]))
    assert int(early.sampled_token_ids[0]) == 2  # both stop id 1 and EOS 3 are held back
    late = Sampler()(logits, _metadata([params], 4, outputs=[[2, 2]]))
    assert int(late.sampled_token_ids[0]) == 1


def test_logprobs_are_raw_with_correct_ranks():
    torch.manual_seed(1)
    vocab = 40
    logits = torch.randn(3, vocab) * 3
    params = [SamplingParams(temperature=0.6, repetition_penalty=1.7, seed=1, logprobs=5),
              SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=2),
              SamplingParams(top_k=3)]
    meta = _metadata(params, vocab, outputs=[[0, 1], [int(logits[1].argmax())], []],
                     prompts=[[2], [3], [4]])
    out = Sampler()(logits, meta)
    lp = out.logprobs
    raw = logits.log_softmax(-1)
    assert lp.top_logprobs.shape == (3, 5)
    ref_values, ref_ids = raw.topk(5, dim=-1)
    assert torch.allclose(lp.top_logprobs, ref_values)
    assert torch.equal(lp.top_token_ids, ref_ids)
    assert torch.equal(lp.token_ids, out.sampled_token_ids)
    assert torch.allclose(lp.token_logprobs, raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    order = raw.argsort(dim=-1, descending=True)
    for row in range(3):
        token = int(out.sampled_token_ids[row])
        assert int(lp.token_ranks[row]) == int((order[row] == token).nonzero()) + 1
    # The frequency penalty moved row 1's greedy pick off the raw argmax, so its rank is > 1.
    assert int(lp.token_ranks[1]) > 1


def test_compute_logprobs_for_prompt_positions():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0],
                           [3.0, 3.0, 0.0, -1.0]])
    result = compute_logprobs(logits, torch.tensor([1, 1]), num_top=2)
    lse0 = math.log(sum(math.exp(x) for x in [0.0, 1.0, 2.0, 3.0]))
    assert result.token_logprobs[0].item() == pytest.approx(1.0 - lse0, abs=1e-6)
    assert result.token_ranks.tolist() == [3, 1]  # a tie with the best token still ranks 1
    assert result.top_token_ids[0].tolist() == [3, 2]
    assert result.top_logprobs[0].tolist() == pytest.approx([3.0 - lse0, 2.0 - lse0], abs=1e-6)
    zero_top = compute_logprobs(logits, torch.tensor([0, 2]), num_top=0)
    assert zero_top.top_token_ids.shape == (2, 0) and zero_top.token_ranks.tolist() == [4, 3]


def _same_metadata(a: SamplingMetadata, b: SamplingMetadata) -> None:
    """Field by field: tensors equal (None where the other is None), host values equal."""
    def same(x, y, name):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None, name
            assert x.dtype == y.dtype and torch.equal(x, y), name
        elif isinstance(x, tuple) and x and isinstance(x[0], torch.Tensor):
            assert y is not None and len(x) == len(y), name
            for i, (u, v) in enumerate(zip(x, y)):
                same(u, v, f"{name}[{i}]")
        else:
            assert x == y, name
    for name in ("temperature", "is_greedy", "all_greedy", "all_random", "top_k", "top_p", "min_p",
                 "min_tokens_mask", "max_num_logprobs", "logit_bias", "max_top_k", "params",
                 "num_output_tokens"):
        same(getattr(a, name), getattr(b, name), name)
    assert a.generators.keys() == b.generators.keys()
    assert all(a.generators[r] is b.generators[r] for r in a.generators)
    assert (a.penalties is None) == (b.penalties is None)
    if a.penalties is not None:
        for name in ("repetition", "frequency", "presence", "output_counts", "prompt_mask"):
            same(getattr(a.penalties, name), getattr(b.penalties, name), f"penalties.{name}")


def test_select_equals_building_from_the_rows_alone():
    """A step builds its metadata once; the eager verify step's plain and verified rows take
    their part with `select`, which must equal `from_params` over those rows."""
    V = 40
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, top_k=5, seed=1),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=3),
              SamplingParams(temperature=1.1, top_p=0.7, min_p=0.05, frequency_penalty=0.4, seed=2),
              SamplingParams(temperature=0.9, min_tokens=3, stop_token_ids=[4, 7], logit_bias={3: 2.0}),
              SamplingParams(temperature=0.0, top_k=9, presence_penalty=0.2, logprobs=1, logit_bias={5: -1.0})]
    outputs = [[1, 2], [3], [], [5, 5, 6], [8], [9, 1, 1]]
    prompts = [[11], [12, 13], [14, 15, 16], [17], [18], [19, 20]]
    generators = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
    full = SamplingMetadata.from_params(params, outputs, prompts, generators, V, "cpu")
    for index in ([0], [1], [0, 2], [1, 3], [4], [2, 5], [0, 1, 4], [1, 2, 3, 5], list(range(6))):
        alone = SamplingMetadata.from_params([params[i] for i in index], [outputs[i] for i in index],
                                             [prompts[i] for i in index], [generators[i] for i in index], V, "cpu")
        _same_metadata(full.select(index), alone)
