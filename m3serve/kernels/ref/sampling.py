"""PyTorch twins of the sampling thresholds (CPU backend and test oracle).

Each returns, per row, the cut-off logit tau: the row keeps exactly the tokens with logit >= tau
(ties at tau stay), and tau = -inf where the row keeps everything.

top-k: tau = the k-th largest logit (k >= vocab: -inf).
top-p: the nucleus is the smallest best-first set whose probability mass reaches p. Mass is
    counted in integers so that every backend adds it up the same way, in any order: token i
    weighs round(exp(l_i - max) x 2^40) (about 1e-12 of the top token: far below fp32's own
    rounding of a probability), Z = the row's total, and the target is ceil(p x Z) in [1, Z].
    tau = the largest logit whose mass at or above it reaches the target. p >= 1 keeps all.
"""
from __future__ import annotations

import torch

MASS_SCALE = 2.0 ** 40  # weight of the row's top token


def token_mass(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] fp32 logits -> [R, V] int64 weights, round(exp(l - row max) x 2^40) in fp32 math."""
    top = logits.amax(dim=-1, keepdim=True)
    return torch.floor(torch.exp(logits - top) * MASS_SCALE + 0.5).to(torch.int64)


def mass_target(p: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """ceil(p x Z) clamped to [1, Z]; p [R] fp32, total [R] int64 -> [R] int64."""
    target = torch.ceil(p.double() * total.double()).to(torch.int64)
    return torch.minimum(target.clamp_min(1), total)


def top_k_threshold_ref(logits: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """logits [R, V] fp32, k [R] int64 in [1, V], max_k = k's largest value -> tau [R] fp32."""
    V = logits.shape[-1]
    best = logits.topk(min(max_k, V), dim=-1).values                      # [R, max_k]
    tau = best.gather(1, (k.clamp(max=best.shape[1]) - 1).unsqueeze(1)).squeeze(1)
    return tau.masked_fill(k >= V, float("-inf"))


def top_p_threshold_ref(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] fp32 (finite or -inf, at least one finite per row), p [R] fp32 in (0, 1]
    -> tau [R] fp32."""
    values, order = logits.sort(dim=-1, descending=True)                  # [R, V]
    mass = token_mass(logits).gather(1, order)                            # [R, V] best first
    cum = mass.cumsum(dim=-1)
    target = mass_target(p, cum[:, -1])
    last = (cum < target.unsqueeze(1)).sum(dim=-1, keepdim=True)          # first index reaching it
    tau = values.gather(1, last).squeeze(1)
    return tau.masked_fill(p >= 1.0, float("-inf"))
