"""The model runner: applies each `SchedulerOutput` to its persistent per-request state, builds
the flattened batch (token ids, positions, slot mapping, block tables, query/context lengths),
runs the model against the paged caches and samples one token per scheduled request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from m3serve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from m3serve.layers.attention_metadata import AttentionMetadata
from m3serve.sampling_params import SamplingParams
from m3serve.worker.sampler import Sampler, SamplingMetadata, compute_logprobs, make_generator


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)


def _plain_greedy(state: CachedRequestState) -> bool:
    """Argmax gives exactly the sampler's answer: greedy, no logprobs, no penalties, and no stop
    token masked by an unmet min_tokens."""
    p = state.sampling_params
    return (p.is_greedy and p.logprobs is None and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and len(state.output_token_ids) >= p.min_tokens)


# per position: (token id, its logprob, its rank, top-n ids, top-n logprobs)
LogprobEntry = tuple[int, float, int, list[int], list[float]]


class ModelRunner:
    """Owns the model and its KV caches on one device (one TP rank)."""

    def __init__(self, model, block_size: int, num_blocks: int, device: torch.device,
                 kv_cache_dtype: torch.dtype | None = None, index_cache_dtype: torch.dtype | None = None,
                 seed: int = 0):
        self.model, self.cfg = model, model.cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.vocab_size = self.cfg.vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.kv_cache_dtype = kv_cache_dtype or model.dtype
        self.index_cache_dtype = index_cache_dtype or model.dtype
        self.graphs = None  # DecodeGraphs, set by the worker when CUDA graphs are on
        self.num_graph_steps = self.num_eager_steps = 0
        self._allocate_caches()

    def _allocate_caches(self) -> None:
        cfg, bs = self.cfg, self.block_size
        attn = self.model.attention_layers
        self.kv_caches = [torch.zeros(2, self.num_blocks, bs, a.num_kv_heads, cfg.head_dim,
                                      dtype=self.kv_cache_dtype, device=self.device) for a in attn]
        self.index_caches = [torch.zeros(self.num_blocks, bs, cfg.index_head_dim, dtype=self.index_cache_dtype,
                                         device=self.device) if a.is_sparse else None for a in attn]
        self.model.bind_kv_caches(self.kv_caches, self.index_caches)
        if self.kv_cache_dtype == torch.float8_e4m3fn:
            # per-layer scales (value = stored x scale); 1.0: K is RMS-normalised and V of order 1
            for a in attn:
                a.k_scale = torch.ones(1, dtype=torch.float32, device=self.device)
                a.v_scale = torch.ones(1, dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------ state updates

    def _apply(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            if req_id in self.requests:
                self.requests[req_id].block_ids = []
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            gen = None
            if params.seed is not None and not params.is_greedy:
                gen = make_generator(params.seed, self.device)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), params, list(new.block_ids),
                new.num_computed_tokens, gen)
        c = so.scheduled_cached_reqs
        for i, req_id in enumerate(c.req_ids):
            state = self.requests[req_id]
            state.output_token_ids.extend(c.new_token_ids[i])
            blocks = c.new_block_ids[i] or []
            if c.resumed_from_preemption[i]:
                state.block_ids = list(blocks)
            else:
                state.block_ids.extend(blocks)
            state.num_computed_tokens = c.num_computed_tokens[i]

    # ------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        states = [self.requests[r] for r in req_ids]
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        bs = self.block_size
        for state in states:
            n = so.num_scheduled_tokens[state.req_id]
            start = state.num_computed_tokens
            ids.extend(self._tokens(state, start, start + n, so.scheduled_spec_decode_tokens.get(state.req_id)))
            blocks = state.block_ids
            for p in range(start, start + n):
                positions.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        dev = self.device
        is_decode = len(ids) == len(states)
        greedy = None
        if self.graphs is not None and is_decode and self.graphs.padded_size(len(states)) is not None:
            hidden = None
            self.num_graph_steps += 1
            logits, greedy = self.graphs.run(ids, positions, slots, seq_lens, [s.block_ids for s in states])
        else:
            self.num_eager_steps += 1
            width = max(len(s.block_ids) for s in states)
            table = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in states],
                                 dtype=torch.int32)
            meta = AttentionMetadata(
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                block_tables=table.to(dev),
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, block_size=bs)
            hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta)
            last = torch.tensor(qsl[1:], device=dev) - 1
            logits = self.model.compute_logits(hidden[last])                    # [R, V] fp32
        params = [s.sampling_params for s in states]
        if all(_plain_greedy(s) for s in states):   # the common benchmark case: argmax only
            sampled = (greedy if greedy is not None else logits.argmax(dim=-1)).tolist()
            logprobs = None
        else:
            sampling = SamplingMetadata.from_params(
                params, [s.output_token_ids for s in states], [s.prompt_token_ids for s in states],
                [s.generator for s in states], self.vocab_size, dev)
            out = self.sampler(logits, sampling)
            sampled = out.sampled_token_ids.tolist()
            logprobs = self._sample_logprobs(out.logprobs, params) if out.logprobs is not None else None
        prompt_logprobs = self._prompt_logprobs(states, so, hidden, qsl) if hidden is not None else {}
        for state in states:
            state.num_computed_tokens += so.num_scheduled_tokens[state.req_id]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[t] for t in sampled],
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _tokens(state: CachedRequestState, start: int, end: int, drafts: list[int] | None) -> list[int]:
        """Tokens [start, end) of prompt + outputs (+ drafts) without copying the whole list."""
        prompt, outputs = state.prompt_token_ids, state.output_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        tail = outputs + (drafts or [])
        if start >= len(prompt):
            return tail[start - len(prompt):end - len(prompt)]
        return prompt[start:] + tail[:end - len(prompt)]

    @staticmethod
    def _sample_logprobs(lp, params: list[SamplingParams]) -> list[list[LogprobEntry] | None]:
        rows = []
        top_ids, top_lps = lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
        tok, tok_lp, rank = lp.token_ids.tolist(), lp.token_logprobs.tolist(), lp.token_ranks.tolist()
        for i, p in enumerate(params):
            if p.logprobs is None:
                rows.append(None)
                continue
            k = p.logprobs
            rows.append([(tok[i], tok_lp[i], rank[i], top_ids[i][:k], top_lps[i][:k])])
        return rows

    def _prompt_logprobs(self, states, so, hidden, qsl) -> dict[str, list[LogprobEntry]]:
        """Logprobs of the prompt tokens this step's chunk predicts (position p predicts p + 1)."""
        out = {}
        for i, state in enumerate(states):
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = state.num_computed_tokens
            n = so.num_scheduled_tokens[state.req_id]
            prompt = state.prompt_token_ids
            end = min(start + n, len(prompt) - 1)             # last position that predicts a prompt token
            if end <= start:
                out[state.req_id] = []
                continue
            logits = self.model.compute_logits(hidden[qsl[i]:qsl[i] + end - start])
            targets = torch.tensor(prompt[start + 1:end + 1], device=logits.device)
            lp = compute_logprobs(logits, targets, k)
            out[state.req_id] = [
                (t, v, r, ids[:k], vals[:k]) for t, v, r, ids, vals in zip(
                    lp.token_ids.tolist(), lp.token_logprobs.tolist(), lp.token_ranks.tolist(),
                    lp.top_token_ids.tolist(), lp.top_logprobs.tolist())]
        return out
