"""Verification of draft tokens: which drafts a request keeps and the token that follows them.

A request with n drafts d_1..d_n has n + 1 target logit rows (positions of [last token, d_1 ..
d_n]); row j is the target's distribution p_j for the token after position j. Drafts are the
draft model's argmax, so its distribution q_j is a point mass on d_j, and the standard rule
reduces to:
- greedy requests: keep the longest prefix with d_j == argmax p_{j-1}, then emit the target's
  argmax at the first mismatch (or after the last draft: the bonus token) -- exactly the tokens
  plain greedy decoding gives;
- sampled requests: keep d_j with probability p_{j-1}(d_j) (= min(1, p/q)); at the first
  rejection emit a sample of normalize(max(p - q, 0)) (p without d_j), after the last draft a
  sample of p_n -- so every emitted token follows the target distribution (lossless). A seeded
  request draws from its own generator, a fixed number of values per verified position.
- synthetic (benchmarks only): the number of kept drafts follows a fixed distribution with a
  configured mean number of emitted tokens; the kept tokens are the drafts themselves (but never
  one a grammar mask forbids).

Returns per request the emitted tokens (1 .. n + 1) as a padded [R, k + 1] tensor and counts.
"""
from __future__ import annotations

import torch

from m3serve.worker.sampler import SamplingMetadata, apply_min_p, apply_top_k_top_p

_TINY = torch.finfo(torch.float32).tiny


def synthetic_acceptance_rate(mean_emitted: float, k: int) -> float:
    """alpha with 1 + alpha + ... + alpha^k = mean_emitted (each draft kept with probability
    alpha once the one before it was), found by bisection."""
    if mean_emitted >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(k + 1)) < mean_emitted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class RejectionSampler:
    def __init__(self, method: str = "standard", synthetic_acceptance_length: float | None = None,
                 num_speculative_tokens: int = 0, generator: torch.Generator | None = None):
        self.method = method
        self.k = num_speculative_tokens
        self.alpha = (synthetic_acceptance_rate(synthetic_acceptance_length, num_speculative_tokens)
                      if method == "synthetic" else None)
        self.generator = generator

    def __call__(self, logits: torch.Tensor, row_start: torch.Tensor, num_drafts: torch.Tensor,
                 drafts: torch.Tensor, sampling: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [N, V] fp32, request r's rows at row_start[r] .. row_start[r] + num_drafts[r];
        drafts: [R, k] int64 (row r's first num_drafts[r] entries valid); sampling: one entry per
        request. -> (emitted [R, k + 1] int64, -1 padded; num_emitted [R] int64)."""
        R, K = drafts.shape
        dev = logits.device
        cols = torch.arange(K + 1, device=dev)
        valid = cols[None, :] <= num_drafts[:, None]                          # [R, K+1] rows that exist
        index = (row_start[:, None] + cols[None, :]).clamp_max(logits.shape[0] - 1)
        target = self._target_tokens(logits, index, valid, drafts, num_drafts, sampling)  # [R, K+1]
        padded = torch.cat([drafts, torch.zeros(R, 1, dtype=drafts.dtype, device=dev)], dim=1)
        if self.method == "synthetic":
            # a draft the row's grammar masks out (-inf) is never kept, whatever the draw
            allowed = logits[index[:, :K].reshape(-1), drafts.reshape(-1)].view(R, K) > float("-inf")
            keep = self._synthetic_keep(R, K, dev) & allowed & (cols[None, :K] < num_drafts[:, None])
        else:
            keep = (padded[:, :K] == target[:, :K]) & (cols[None, :K] < num_drafts[:, None])
        # kept drafts = the leading run of kept positions
        num_kept = torch.cumprod(keep.to(torch.int64), dim=1).sum(dim=1)      # [R]
        emitted = torch.where(cols[None, :] < num_kept[:, None], padded, target)
        num_emitted = num_kept + 1
        emitted = emitted.masked_fill(cols[None, :] >= num_emitted[:, None], -1)
        return emitted, num_emitted

    def _target_tokens(self, logits, index, valid, drafts, num_drafts, sampling):
        """The token the target puts at each row: its argmax (greedy requests and synthetic
        mode), or for sampled requests the draft itself where it is accepted and otherwise a
        sample of p without the draft (the bonus row: a sample of p)."""
        R, K1 = index.shape
        flat = logits[index.reshape(-1)]                                      # [R*(K+1), V]
        greedy = flat.argmax(dim=-1).view(R, K1)
        if sampling.all_greedy:
            return greedy
        V = flat.shape[1]
        rep = torch.repeat_interleave
        temp = rep(sampling.temperature, K1)
        x = flat / temp[:, None]
        top_k = rep(sampling.top_k, K1) if sampling.top_k is not None else None
        top_p = rep(sampling.top_p, K1) if sampling.top_p is not None else None
        x = apply_top_k_top_p(x, top_k, top_p, sampling.max_top_k)
        if sampling.min_p is not None:
            x = apply_min_p(x, rep(sampling.min_p, K1))
        probs = x.softmax(dim=-1).view(R, K1, V)
        uniform, noise = self._draws(R, K1, V, sampling.generators, flat.device)
        d = torch.cat([drafts, torch.zeros(R, 1, dtype=drafts.dtype, device=flat.device)], dim=1)
        is_draft_row = torch.arange(K1, device=flat.device)[None, :] < num_drafts[:, None]   # [R, K+1]
        p_draft = probs.gather(2, d[:, :, None]).squeeze(2)                   # [R, K+1]
        accept = is_draft_row & (uniform < p_draft)
        residual = probs.clone()
        residual.scatter_(2, d[:, :, None], 0.0)                              # p without the draft
        residual = torch.where(is_draft_row[:, :, None], residual, probs)     # bonus row: p itself
        # exponential race over the residual (normalisation does not change its argmax)
        resampled = (residual.clamp_min(0).log() - noise.log()).argmax(dim=-1)
        sampled = torch.where(accept, d, resampled)
        return torch.where(sampling.is_greedy[:, None], greedy, sampled)

    def _draws(self, R: int, K1: int, V: int, generators: dict[int, torch.Generator], device):
        """[R, K+1] uniforms and [R, K+1, V] exponentials; a seeded row draws its own, always
        the same amount per verify step, so its tokens do not depend on its neighbours."""
        uniform = torch.empty(R, K1, device=device)
        noise = torch.empty(R, K1, V, device=device)
        if len(generators) < R:
            uniform.uniform_(generator=self.generator)
            noise.exponential_(generator=self.generator)
        for row, gen in generators.items():
            uniform[row].uniform_(generator=gen)
            noise[row].exponential_(generator=gen)
        return uniform, noise.clamp_min_(_TINY)

    def _synthetic_keep(self, R: int, K: int, device) -> torch.Tensor:
        u = torch.rand(R, K, device=device, generator=self.generator)
        return u < self.alpha
