"""Batched token sampling: one step's logits -> one sampled token per request (+ logprobs).

`SamplingMetadata` packs a batch's `SamplingParams` into tensors once per step; `Sampler` applies
min-tokens, penalties, greedy/temperature, top-k, top-p and min-p, then samples with an
exponential race whose noise comes from a per-request generator for seeded requests, so a
seeded request draws the same tokens whatever else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from m3serve.kernels.ref.sampling import top_k_threshold_ref, top_p_threshold_ref
from m3serve.kernels.sampling import top_k_threshold, top_p_threshold
from m3serve.layers.dispatch import use_triton
from m3serve.sampling_params import SamplingParams

# Smallest positive fp32; exponential noise is clamped to it so -log(q) stays finite and a
# masked (-inf) logit can never become nan and win the argmax.
_TINY = torch.finfo(torch.float32).tiny


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator for a seeded request; create it once at admission and keep it
    for the request's lifetime (re-creating it each step would repeat the same draws)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class PenaltyTensors:
    """Penalty inputs for one step; rows without penalties hold neutral values."""
    repetition: torch.Tensor              # [num_reqs] fp32, 1.0 = off
    frequency: torch.Tensor               # [num_reqs] fp32, 0.0 = off
    presence: torch.Tensor                # [num_reqs] fp32, 0.0 = off
    output_counts: torch.Tensor           # [num_reqs, vocab] fp32, occurrences in the output
    prompt_mask: torch.Tensor | None      # [num_reqs, vocab] bool; None when no repetition penalty


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without a stream sync: through pinned memory to a GPU (the
    copy is ordered on the stream and the pinned block is not reused before it is done), so a
    deferred step can build its inputs while the GPU still runs."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, as tensors on the logits' device.

    Optional tensors are None when no row in the batch uses the feature, so the common
    all-defaults batch skips that work entirely. Built once per step (`from_params`); a part of
    the step's rows is taken with `select`.
    """
    temperature: torch.Tensor                 # [num_reqs] fp32; 1.0 on greedy rows
    is_greedy: torch.Tensor                   # [num_reqs] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None                # [num_reqs] int64 in [1, vocab]; vocab = off
    top_p: torch.Tensor | None                # [num_reqs] fp32 in (0, 1]; 1.0 = off
    min_p: torch.Tensor | None                # [num_reqs] fp32 in [0, 1]; 0.0 = off
    generators: dict[int, torch.Generator]    # row -> generator, for seeded non-greedy rows
    penalties: PenaltyTensors | None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token_ids) to forbid
    max_num_logprobs: int | None              # largest `logprobs` in the batch; None = none asked
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, ids, added values)
    max_top_k: int | None = None              # the largest top_k, known on the host (no sync)
    params: tuple[SamplingParams, ...] = ()   # host side, per row: what `select` re-reads
    num_output_tokens: tuple[int, ...] = ()   # host side, per row
    vocab_size: int = 0

    @classmethod
    def from_params(
        cls,
        params_list: list[SamplingParams],
        output_token_ids,
        prompt_token_ids,
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Build the step's metadata. All lists are indexed by batch row.

        output_token_ids[i] are the tokens request i has generated so far (for penalties and
        min_tokens); prompt_token_ids[i] its prompt (only read for repetition penalty).
        generators[i] must be the request's own generator when params_list[i].seed is set
        (see `make_generator`); None rows share the sampler's generator.
        """
        num_reqs = len(params_list)
        for name, seq in (("output_token_ids", output_token_ids),
                          ("prompt_token_ids", prompt_token_ids), ("generators", generators)):
            if len(seq) != num_reqs:
                raise ValueError(f"{name} has {len(seq)} rows, expected {num_reqs}")

        greedy = [p.is_greedy for p in params_list]
        temperature = [1.0 if g else p.temperature for p, g in zip(params_list, greedy)]
        row_generators = {}
        for row, (p, g) in enumerate(zip(params_list, greedy)):
            if g:
                continue  # greedy rows draw no noise, so their generator must not advance
            if p.seed is not None and generators[row] is None:
                raise ValueError(f"request in row {row} has seed={p.seed} but no generator")
            if generators[row] is not None:
                row_generators[row] = generators[row]

        def tensor(values, dtype):
            return to_device(torch.tensor(values, dtype=dtype), device)

        use = _Uses(params_list, vocab_size)
        num_outputs = tuple(len(ids) for ids in output_token_ids)

        return cls(
            temperature=tensor(temperature, torch.float32),
            is_greedy=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=tensor(use.top_k_values, torch.int64) if use.top_k else None,
            top_p=tensor([p.top_p for p in params_list], torch.float32) if use.top_p else None,
            min_p=tensor([p.min_p for p in params_list], torch.float32) if use.min_p else None,
            generators=row_generators,
            penalties=_build_penalties(params_list, output_token_ids, prompt_token_ids,
                                       vocab_size, device),
            min_tokens_mask=_build_min_tokens_mask(params_list, num_outputs, vocab_size, device),
            max_num_logprobs=use.max_num_logprobs,
            logit_bias=_build_logit_bias(params_list, device),
            max_top_k=max(use.top_k_values) if use.top_k else None,
            params=tuple(params_list), num_output_tokens=num_outputs, vocab_size=vocab_size,
        )

    def select(self, index: list[int]) -> SamplingMetadata:
        """The metadata of rows `index` (ascending), equal to `from_params` over those rows
        alone, without rebuilding the step's tensors: the large ones (penalty counts, prompt
        masks) are indexed, the small host-side ones rebuilt from the rows' params."""
        if list(index) == list(range(len(self.params))):
            return self
        params = [self.params[i] for i in index]
        device = self.temperature.device
        rows = to_device(torch.tensor(index, dtype=torch.int64), device)
        greedy = [p.is_greedy for p in params]
        use = _Uses(params, self.vocab_size)
        where = {old: new for new, old in enumerate(index)}
        penalties = None
        if use.repetition or use.frequency_presence:
            pen = self.penalties
            penalties = PenaltyTensors(pen.repetition[rows], pen.frequency[rows], pen.presence[rows],
                                       pen.output_counts[rows],
                                       pen.prompt_mask[rows] if use.repetition else None)
        return SamplingMetadata(
            temperature=self.temperature[rows], is_greedy=self.is_greedy[rows],
            all_greedy=all(greedy), all_random=not any(greedy),
            top_k=self.top_k[rows] if use.top_k else None,
            top_p=self.top_p[rows] if use.top_p else None,
            min_p=self.min_p[rows] if use.min_p else None,
            generators={where[r]: g for r, g in self.generators.items() if r in where},
            penalties=penalties,
            min_tokens_mask=_build_min_tokens_mask(params, [self.num_output_tokens[i] for i in index],
                                                   self.vocab_size, device),
            max_num_logprobs=use.max_num_logprobs,
            logit_bias=_build_logit_bias(params, device),
            max_top_k=max(use.top_k_values) if use.top_k else None,
            params=tuple(params), num_output_tokens=tuple(self.num_output_tokens[i] for i in index),
            vocab_size=self.vocab_size)


class _Uses:
    """Which optional features a set of rows uses (truncations count on non-greedy rows only)."""

    def __init__(self, params_list: list[SamplingParams], vocab_size: int):
        sampled = [p for p in params_list if not p.is_greedy]
        self.top_k = any(p.top_k > 0 for p in sampled)
        self.top_p = any(p.top_p < 1.0 for p in sampled)
        self.min_p = any(p.min_p > 0.0 for p in sampled)
        self.top_k_values = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params_list]
        self.repetition = any(p.repetition_penalty != 1.0 for p in params_list)
        self.frequency_presence = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                                      for p in params_list)
        logprobs = [p.logprobs for p in params_list if p.logprobs is not None]
        self.max_num_logprobs = max(logprobs) if logprobs else None


def _build_logit_bias(params_list, device):
    entries = [(row, token, bias) for row, p in enumerate(params_list) for token, bias in (p.logit_bias or {}).items()]
    if not entries:
        return None
    rows, ids, values = zip(*entries)
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def _token_index(rows_of_ids, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ragged per-row token id sequences (lists or arrays) into (row index, token id)
    tensors, without a Python loop over tokens."""
    arrays = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in rows_of_ids]
    rows = np.repeat(np.arange(len(arrays), dtype=np.int64), [len(a) for a in arrays])
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(rows).to(device), torch.from_numpy(flat).to(device)


def _build_penalties(params_list, output_token_ids, prompt_token_ids, vocab_size, device):
    has_rep = [p.repetition_penalty != 1.0 for p in params_list]
    has_freq_pres = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                     for p in params_list]
    if not any(has_rep) and not any(has_freq_pres):
        return None
    num_reqs = len(params_list)
    # Only rows that use a penalty contribute tokens: histories can be long (1M context).
    used_outputs = [ids if (r or f) else [] for ids, r, f in
                    zip(output_token_ids, has_rep, has_freq_pres)]
    rows, ids = _token_index(used_outputs, device)
    output_counts = torch.zeros(num_reqs, vocab_size, dtype=torch.float32, device=device)
    output_counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32),
                             accumulate=True)
    prompt_mask = None
    if any(has_rep):
        rows, ids = _token_index([ids if r else [] for ids, r in
                                  zip(prompt_token_ids, has_rep)], device)
        prompt_mask = torch.zeros(num_reqs, vocab_size, dtype=torch.bool, device=device)
        prompt_mask[rows, ids] = True

    def tensor(values):
        return torch.tensor(values, dtype=torch.float32, device=device)

    return PenaltyTensors(
        repetition=tensor([p.repetition_penalty for p in params_list]),
        frequency=tensor([p.frequency_penalty for p in params_list]),
        presence=tensor([p.presence_penalty for p in params_list]),
        output_counts=output_counts,
        prompt_mask=prompt_mask,
    )


def _build_min_tokens_mask(params_list, num_output_tokens, vocab_size, device):
    forbidden = []
    for p, n in zip(params_list, num_output_tokens):
        if n < p.min_tokens:
            # Ids past the logits' vocab cannot be sampled anyway; the API layer rejects them.
            forbidden.append(sorted(t for t in p.all_stop_token_ids if t < vocab_size))
        else:
            forbidden.append([])
    if not any(forbidden):
        return None
    return _token_index(forbidden, device)


@dataclass
class LogprobsTensors:
    """Log-probabilities for a set of positions (decode rows or prompt positions).

    The top columns hold the batch's largest requested count; a request asking for fewer
    slices `[:, :k]`. Ranks are 1-based: 1 + the number of tokens with a strictly larger logprob.
    """
    top_token_ids: torch.Tensor     # [num_positions, num_top] int64, best first
    top_logprobs: torch.Tensor      # [num_positions, num_top] fp32
    token_ids: torch.Tensor         # [num_positions] int64, the sampled / actual next token
    token_logprobs: torch.Tensor    # [num_positions] fp32
    token_ranks: torch.Tensor       # [num_positions] int64


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor       # [num_reqs] int64
    logprobs: LogprobsTensors | None      # None when no request in the batch asked for logprobs


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_top: int) -> LogprobsTensors:
    """Top-`num_top` logprobs per row plus the logprob and rank of `token_ids[row]`.

    logits: [num_positions, vocab]; token_ids: [num_positions]. For prompt logprobs, pass the
    logits of positions 0..L-2 with the prompt tokens 1..L-1 (chunk long prompts: this makes a
    [num_positions, vocab] fp32 temporary).
    """
    logprobs = logits.float().log_softmax(dim=-1)  # [num_positions, vocab]
    token_ids = token_ids.to(torch.int64)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [num_positions]
    token_ranks = (logprobs > token_logprobs.unsqueeze(1)).sum(dim=-1) + 1  # [num_positions]
    top_logprobs, top_token_ids = logprobs.topk(num_top, dim=-1)  # [num_positions, num_top]
    return LogprobsTensors(top_token_ids, top_logprobs, token_ids, token_logprobs, token_ranks)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """Repetition (prompt + output tokens: positive logits divided, negative multiplied), then
    frequency (minus penalty x count) and presence (minus penalty if seen), over output only."""
    counts = penalties.output_counts                          # [num_reqs, vocab]
    seen_in_output = counts > 0                               # [num_reqs, vocab]
    seen = seen_in_output
    if penalties.prompt_mask is not None:
        seen = seen | penalties.prompt_mask
    rep = torch.where(seen, penalties.repetition.unsqueeze(1), 1.0)  # [num_reqs, vocab]
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - penalties.frequency.unsqueeze(1) * counts
    return logits - penalties.presence.unsqueeze(1) * seen_in_output.float()


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, max_top_k: int | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus: the
    smallest set of best tokens whose probability mass (after top-k) reaches p. Ties at either
    cut-off stay. Each cut-off is one logit per row (`kernels/ref/sampling.py` defines both): on
    CUDA found by a radix search, with no [R, vocab] sort. max_top_k: top_k's largest value,
    known on the host (`SamplingMetadata.max_top_k`: reading it from the device would sync)."""
    triton_ok = (top_k is not None or top_p is not None) and use_triton("top_k_top_p", logits)
    if top_k is not None:
        logits = _below_to_inf(logits, top_k_threshold(logits, top_k) if triton_ok else
                               top_k_threshold_ref(logits, top_k, max_top_k))
    if top_p is not None:
        logits = _below_to_inf(logits, top_p_threshold(logits, top_p) if triton_ok else
                               top_p_threshold_ref(logits, top_p))
    return logits


def _below_to_inf(logits: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with each row's values below tau [R] set to -inf."""
    return logits.masked_fill(logits < tau.unsqueeze(1), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p x the row's top probability. Done in log
    space (logit - max < log min_p), which needs no softmax; min_p = 0 gives log 0 = -inf."""
    max_logits = logits.max(dim=-1, keepdim=True).values  # [num_reqs, 1]
    threshold = min_p.log().unsqueeze(1)                   # [num_reqs, 1]
    return logits.masked_fill(logits - max_logits < threshold, float("-inf"))


class Sampler(nn.Module):
    """Samples one token per row. Output logprobs are taken from the RAW logits (before
    min-tokens, penalties, temperature and truncation), as vLLM's default `raw_logprobs` mode:
    they describe the model's distribution, not the sampling-adjusted one.

    Order: raw logprobs; min_tokens (stop ids -> -inf); repetition, frequency, presence
    penalties; greedy rows take argmax; other rows divide by temperature, apply top-k, top-p,
    then min-p, and sample by exponential race argmax(logits - log q), q ~ Exp(1), which is
    exact sampling from softmax(logits) (the Gumbel-max trick).
    """

    def __init__(self, generator: torch.Generator | None = None):
        super().__init__()
        self.generator = generator  # shared noise source for unseeded rows; None = torch's global

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [num_reqs, vocab]. The input tensor is not modified."""
        raw_logits = logits.float()  # [num_reqs, vocab]
        logits = raw_logits
        if metadata.logit_bias is not None:        # OpenAI's logit_bias: added to the raw logits
            rows, ids, values = metadata.logit_bias
            logits = logits.index_put((rows, ids), values, accumulate=True)
        if metadata.min_tokens_mask is not None:
            logits = logits.index_put(metadata.min_tokens_mask,
                                      torch.tensor(float("-inf"), device=logits.device))
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)
        sampled = self.sample(logits, metadata)  # [num_reqs]
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw_logits, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Penalised logits [num_reqs, vocab] -> token ids [num_reqs] int64."""
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy
        logits = logits / metadata.temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        random = self._exponential_race(logits, metadata.generators)
        if metadata.all_random:
            return random
        return torch.where(metadata.is_greedy, greedy, random)

    def _exponential_race(self, logits: torch.Tensor,
                          generators: dict[int, torch.Generator]) -> torch.Tensor:
        noise = torch.empty_like(logits)  # [num_reqs, vocab]
        if len(generators) < logits.shape[0]:
            noise.exponential_(generator=self.generator)
        # Each seeded row draws exactly `vocab` values from its own generator per step, so its
        # tokens do not depend on its batch neighbours.
        for row, generator in generators.items():
            noise[row].exponential_(generator=generator)
        return (logits - noise.clamp_min_(_TINY).log()).argmax(dim=-1)
