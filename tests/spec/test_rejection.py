"""The rejection sampler: lossless in distribution (a chi-square test with a deliberately bad
draft), greedy exactly the target's argmax run, seeded rows reproducible and independent of their
neighbours, and the synthetic mode's mean acceptance length as configured."""
import math

import pytest
import torch

from m3serve.sampling_params import SamplingParams
from m3serve.worker.rejection import RejectionSampler, synthetic_acceptance_rate
from m3serve.worker.sampler import SamplingMetadata, make_generator

V = 8


def _sampling(params, generators=None):
    n = len(params)
    return SamplingMetadata.from_params(params, [[] for _ in range(n)], [[1] for _ in range(n)],
                                        generators or [None] * n, V, "cpu")


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sampling_is_lossless_with_a_bad_draft():
    """R requests, each with one draft: the worst token under p. The first emitted token must
    follow p (it is the draft when accepted, else a resample of p without it); the bonus token
    (both drafts of a 2-draft request accepted) must follow p at the next position."""
    torch.manual_seed(0)
    p0 = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])
    p1 = torch.tensor([0.05, 0.05, 0.40, 0.10, 0.10, 0.10, 0.10, 0.10])
    R = 40000
    logits = torch.stack([p0.log(), p1.log()]).repeat(R, 1)                   # rows 2r, 2r+1
    drafts = torch.full((R, 1), 7)                                             # p0(7) = 0.02
    sampler = RejectionSampler(num_speculative_tokens=1, generator=torch.Generator().manual_seed(1))
    emitted, count = sampler(logits, torch.arange(R) * 2, torch.ones(R, dtype=torch.int64), drafts,
                             _sampling([SamplingParams(temperature=1.0)] * R))
    first = torch.bincount(emitted[:, 0], minlength=V).float()
    # 7 degrees of freedom: the 0.1 % critical value is 24.3
    assert _chi_square(first, p0) < 24.3
    accepted = count == 2
    assert abs(accepted.float().mean().item() - 0.02) < 0.005
    bonus = torch.bincount(emitted[accepted, 1], minlength=V).float()
    assert bonus.sum() > 500 and _chi_square(bonus, p1) < 24.3


def test_top_k_temperature_target_distribution():
    """The target distribution is the processed one (temperature, top-k), as without drafts."""
    logits0 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])
    params = SamplingParams(temperature=0.7, top_k=3)
    p = torch.softmax(logits0 / 0.7, -1)
    p[3:] = 0
    p /= p.sum()
    R = 30000
    sampler = RejectionSampler(num_speculative_tokens=1, generator=torch.Generator().manual_seed(2))
    emitted, _ = sampler(logits0.repeat(2 * R, 1), torch.arange(R) * 2, torch.ones(R, dtype=torch.int64),
                         torch.full((R, 1), 1), _sampling([params] * R))
    counts = torch.bincount(emitted[:, 0], minlength=V).float()
    assert counts[3:].sum() == 0 and _chi_square(counts[:3], p[:3]) < 13.8   # 2 dof, 0.1 %


def test_greedy_keeps_the_matching_prefix():
    logits = torch.full((5, V), -5.0)
    for row, best in enumerate([3, 4, 1, 6, 2]):
        logits[row, best] = 5.0
    # request 0: drafts 3, 4, 7 over rows 0..3 (argmax 3, 4, 1, 6): keeps 3, 4, then emits 1
    # request 1: no drafts, row 4: emits 2
    sampler = RejectionSampler(num_speculative_tokens=3)
    drafts = torch.tensor([[3, 4, 7], [0, 0, 0]])
    emitted, count = sampler(logits, torch.tensor([0, 4]), torch.tensor([3, 0]), drafts,
                             _sampling([SamplingParams(temperature=0)] * 2))
    assert count.tolist() == [3, 1]
    assert emitted[0, :3].tolist() == [3, 4, 1] and emitted[1, 0].item() == 2


def test_seeded_rows_reproducible_and_independent_of_neighbours():
    torch.manual_seed(3)
    base = torch.randn(2, V)
    seeded = SamplingParams(temperature=1.0, seed=11)

    def run(neighbours: int):
        params = [SamplingParams(temperature=1.0)] * neighbours + [seeded]
        gens = [None] * neighbours + [make_generator(11, "cpu")]
        logits = torch.cat([torch.randn(2 * neighbours, V), base])
        sampler = RejectionSampler(num_speculative_tokens=1, generator=torch.Generator().manual_seed(neighbours))
        emitted, count = sampler(logits, torch.arange(neighbours + 1) * 2,
                                 torch.ones(neighbours + 1, dtype=torch.int64),
                                 torch.full((neighbours + 1, 1), 5), _sampling(params, gens))
        return emitted[-1, :count[-1]].tolist()

    assert run(0) == run(3) == run(7)


@pytest.mark.parametrize("k,mean", [(3, 2.78), (3, 2.83), (4, 1.5)])
def test_synthetic_mean_acceptance_length(k, mean):
    alpha = synthetic_acceptance_rate(mean, k)
    assert math.isclose(sum(alpha ** i for i in range(k + 1)), mean, rel_tol=1e-9)
    R = 20000
    sampler = RejectionSampler("synthetic", mean, k, torch.Generator().manual_seed(4))
    logits = torch.randn(R * (k + 1), V)
    _, count = sampler(logits, torch.arange(R) * (k + 1), torch.full((R,), k), torch.randint(0, V, (R, k)),
                       _sampling([SamplingParams(temperature=0)] * R))
    # standard error of the mean <= sqrt(var / R) < 0.012 here: a 0.05 band is > 4 sigma
    assert abs(count.float().mean().item() - mean) < 0.05


def test_synthetic_mode_never_keeps_a_draft_a_grammar_masks_out():
    """With a grammar's mask on the verified rows (-inf where it forbids a token), synthetic
    acceptance keeps no masked draft (nor any after it), however likely its draw."""
    k, R = 3, 2000
    sampler = RejectionSampler("synthetic", 3.9, k, torch.Generator().manual_seed(5))   # alpha ~ 0.97
    logits = torch.randn(R * (k + 1), V)
    drafts = torch.randint(0, V, (R, k))
    masked = torch.arange(R) % 3 == 0                     # these rows forbid their second draft
    logits[(torch.arange(R) * (k + 1) + 1)[masked], drafts[masked, 1]] = float("-inf")
    _, count = sampler(logits, torch.arange(R) * (k + 1), torch.full((R,), k), drafts,
                       _sampling([SamplingParams(temperature=0)] * R))
    assert int(count[masked].max()) == 2                  # the first draft at most, then the target's token
    assert float(count[~masked].float().mean()) > 3.5
