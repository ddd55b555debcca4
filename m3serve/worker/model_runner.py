"""The model runner of one rank: `execute_model(scheduler_output)` = apply the diff to the
persistent input batch -> stage the step's inputs (one copy) -> forward (CUDA-graph replay for
pure decode, eager otherwise) -> sample (the driver rank only) -> `ModelRunnerOutput`.

Every rank of a TP group runs the same steps on the same batch state and takes the same
decisions (graph or eager, argmax or full logits, which prompt logprobs), so the collectives
inside line up; only the driver (TP rank 0) samples and returns tokens. Sampled tokens reach
the other ranks as the next step's `new_token_ids`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from m3serve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from m3serve.worker.attn_metadata import StepBuffers
from m3serve.worker.cuda_graphs import DecodeGraphs
from m3serve.worker.input_batch import InputBatch, ScheduledBatch
from m3serve.worker.sampler import (Sampler, SamplingMetadata, apply_top_k_top_p, compute_logprobs,
                                    to_device)

# per position: (token id, its logprob, its rank, top-n ids, top-n logprobs)
LogprobEntry = tuple[int, float, int, list[int], list[float]]


@dataclass
class _DeferredTokens:
    """A deferred step's sampled ids (async scheduling): on the device for the next step's
    inputs, and on their way to a pinned host buffer for the output."""
    req_ids: list[str]            # the step's requests, in batch order
    sampled: dict[str, int]       # request id -> index of its real token (complete contexts)
    device: torch.Tensor          # [R] int64
    host: torch.Tensor            # [>= R] int64, pinned on a GPU
    copied: object                # torch.cuda.Event, or None on CPU


@dataclass
class DPStep:
    """What the DP replicas agreed on for one step, so their MoE exchanges line up: the
    largest token and request counts among them, and whether every one is a pure decode."""
    num_tokens: int
    num_reqs: int
    all_decode: bool


class ModelRunner:
    """Owns the model, its KV caches and the input batch on one device."""

    def __init__(self, model, block_size: int, num_blocks: int, device: torch.device,
                 max_model_len: int, max_num_reqs: int, max_num_tokens: int,
                 kv_cache_dtype: torch.dtype | None = None, index_cache_dtype: torch.dtype | None = None,
                 seed: int = 0, is_driver: bool = True, sample_everywhere: bool = False,
                 extra_positions: int = 0):
        self.model, self.cfg = model, model.cfg
        self.block_size, self.num_blocks, self.device = block_size, num_blocks, device
        self.max_model_len = max_model_len
        self.is_driver = is_driver
        self.vocab_size = self.cfg.vocab_size
        # every rank samples when speculating (the proposer starts from the emitted tokens)
        samples = is_driver or sample_everywhere
        self.batch = InputBatch(max_model_len, block_size, device, capacity=max_num_reqs,
                                make_generators=samples, extra_positions=extra_positions)
        self.buffers = StepBuffers(max_num_reqs, max_num_tokens, self.batch.max_blocks, block_size, device)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed)) if samples else None
        self.kv_cache_dtype = kv_cache_dtype or model.dtype
        self.index_cache_dtype = index_cache_dtype or model.dtype
        self.dp_exchange = model.parallel.dp.active
        self.graphs: DecodeGraphs | None = None
        self.proposer = None          # spec.proposer.Proposer when speculating (set by the worker)
        self.spec_graphs = None       # worker.spec_graphs.SpecDecodeGraphs, with the proposer on a GPU
        self.rejection = None         # spec.rejection.RejectionSampler, with the proposer
        self.record_selections: list | None = None   # tests: sparse layers append their choices
        self.vision = None            # model.vision.VisionEncoder when images are served (set by the worker)
        self.media: dict = {}         # request id -> worker.media.MediaFeatures
        self.hidden: torch.Tensor | None = None      # the last step's final hidden states
        self.num_graph_steps = self.num_eager_steps = 0
        self.grammars = None          # worker.structured.GrammarBook on the sampling rank (set by the worker)
        self._deferred: _DeferredTokens | None = None
        self.failed: dict[str, str] = {}   # the last sampled step's requests that cannot go on: why
        # async scheduling: two pinned buffers (each with its copy's event), used in turn, so a
        # step's copy never overwrites the one being read
        cuda = device.type == "cuda"
        self._host_ids = [(torch.zeros(max_num_reqs, dtype=torch.int64, pin_memory=cuda),
                           torch.cuda.Event() if cuda else None) for _ in range(2)]
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

    def capture_cuda_graphs(self, sizes: list[int]) -> None:
        self.graphs = DecodeGraphs(self.model, self.buffers, sizes, self.max_model_len, self.dp_exchange)
        self.graphs.capture(self.batch)

    def warm_up_shapes(self, max_tokens: int) -> list[tuple[list[int], list[int]]]:
        """(query lengths, context lengths) of the start-up warm-up's forwards: a short prompt;
        a prompt in every fused-MoE tile regime up to max_tokens, alone and beside 7 decodes
        (mixed steps take other attention and indexer layouts; the mixed total is not a
        multiple of 16, the lone prompts are); and a short chunk at the end of a context in
        every wider bucket of the indexer's top-k up to the model's context length."""
        from m3serve.kernels.indexer import TOPK_MIN_COLUMNS
        moe = next((layer.mlp for layer in self.model.model.layers if layer.is_moe), None)
        counts = moe.tile_token_counts(max_tokens) if moe is not None else [max_tokens]
        short = min(16, max_tokens)
        shapes = [([short], [short])]
        for t in counts:
            shapes.append(([t], [t]))
            if t > 8 and self.buffers.max_reqs >= 8:
                shapes.append(([t - 8] + [1] * 7, [t - 8] + [1] * 7))
        width, context = 2 * TOPK_MIN_COLUMNS, self.buffers.max_blocks * self.block_size
        while width // 2 * self.block_size < context:
            shapes.append(([short], [min(context, width * self.block_size)]))
            width *= 2
        return shapes

    @torch.inference_mode()
    def warm_up(self, shapes: list[tuple[list[int], list[int]]]) -> None:
        """Eager forwards (with the logits of each row's last token) over rows on the null page,
        one per (query lengths, context lengths) in `shapes`: every Triton variant those step
        layouts need compiles here, not inside a served step. Every rank runs the same shapes,
        so the forwards' collectives match; no real block is read or written."""
        for query_lens, context_lens in shapes:
            qsl, seq = self.buffers.stage_null(query_lens, context_lens)
            n, t = len(query_lens), qsl[-1]
            ids, positions, meta = self.buffers.inputs(
                n, t, max(query_lens) == 1, qsl, seq, max_query_len=max(query_lens),
                max_seq_len=max(seq), dp_padded_tokens=t if self.dp_exchange else 0)
            hidden = self.model(ids, positions, meta)
            last = torch.tensor(qsl[1:], device=hidden.device) - 1
            self.model.lm_head.local_logits(hidden[last])
        if self.sampler is not None:       # the top-k / top-p cut-off kernels (one variant each)
            logits = torch.zeros(1, self.vocab_size, device=self.device)
            apply_top_k_top_p(logits, torch.ones(1, dtype=torch.int64, device=self.device),
                              torch.full((1,), 0.5, device=self.device), 1)

    # ------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, dp: DPStep | None = None) -> ModelRunnerOutput | None:
        """One step. `dp` is set when the MoE layers exchange tokens with other DP replicas:
        then a step without requests still runs a padding forward. Returns None on ranks that
        do not sample.

        Async scheduling: a `deferred` step leaves its argmax ids on the device and returns no
        tokens; the next call takes them as its inputs (placeholders the scheduler counted),
        launches its own forward, and only then waits for them, returning them as `previous`."""
        if self.grammars is not None:
            for req_id in so.finished_req_ids:
                self.grammars.drop(req_id)
        self._track_media(so)
        prev, self._deferred = self._deferred, None
        placeholders = self.batch.apply(so, prev.sampled if prev is not None else ())
        if not so.num_scheduled_tokens:
            if dp is not None:
                self._forward(None, dp)
            previous = self._land(prev, placeholders)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], previous=previous) if self.is_driver else None
        batch = self.batch.schedule(so)
        if self.proposer is not None:
            return self._speculative_step(so, batch, dp)
        hidden, local, greedy = self._forward(batch, dp, self._feed_of(batch, prev, placeholders))
        if so.deferred:
            done = self._complete(batch)                                         # [R]
            if self.batch.all_plain_greedy(batch.rows[done]):
                self._defer(batch, greedy if greedy is not None else self.model.lm_head.greedy(local),
                            so.sampled_req_ids)
                previous = self._land(prev, placeholders)
            else:   # sampled on the device; the previous ids land first: the history is whole
                previous = self._land(prev, placeholders)
                self._defer(batch, self._sample_on_device(batch, local, done), so.sampled_req_ids)
            self.batch.advance(batch)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], previous=previous) if self.is_driver else None
        previous = self._land(prev, placeholders)       # before sampling: the host history is whole
        sampled, logprobs = self._sample(batch, local, greedy)
        prompt_logprobs = self._prompt_logprobs(batch, hidden)
        self.batch.advance(batch)
        if not self.is_driver:
            return None
        return ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=[[t] for t in sampled],
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs, failed=self.failed,
                                 previous=previous)

    # ------------------------------------------------------------ images and videos

    def _track_media(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.media.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.mm_inputs:
                from m3serve.worker.media import MediaFeatures
                self.media[new.req_id] = MediaFeatures(new.prompt_token_ids, new.mm_inputs,
                                                       self.cfg.image_token_id, self.cfg.video_token_id)

    def _media_embeds(self, batch: ScheduledBatch | None):
        """(step token slots [k], features [k, H]) of the placeholders this step computes
        (encoding the images it reaches for the first time), or None."""
        if batch is None or not self.media:
            return None
        slots, rows = [], []
        start = batch.seq_lens - batch.num_scheduled                       # [R]
        for i, req_id in enumerate(batch.req_ids):
            media = self.media.get(req_id)
            if media is None:
                continue
            found = media.rows(int(start[i]), int(batch.seq_lens[i]), self.vision)
            if found is not None:
                offsets, feats = found
                slots.append(torch.from_numpy(offsets + int(batch.query_start_loc[i])))
                rows.append(feats)
        if not slots:
            return None
        return torch.cat(slots).to(self.device), torch.cat(rows)

    # ------------------------------------------------------------ async scheduling

    def _feed_of(self, batch: ScheduledBatch, prev: _DeferredTokens | None, placeholders):
        """(this step's token slots, their sources in prev's ids, prev's device ids) for the
        placeholders this step reads, or None."""
        if not placeholders:
            return None
        where = {req_id: i for i, req_id in enumerate(batch.req_ids)}
        start = batch.seq_lens - batch.num_scheduled                       # [R]
        slots, sources = [], []
        for req_id, pos in placeholders:
            i = where.get(req_id)
            if i is not None and start[i] <= pos < batch.seq_lens[i]:
                slots.append(int(batch.query_start_loc[i]) + pos - int(start[i]))
                sources.append(prev.sampled[req_id])
        if not slots:
            return None
        return np.asarray(slots, dtype=np.int32), np.asarray(sources, dtype=np.int32), prev.device

    def _stage(self, batch: ScheduledBatch | None, pad_to: int = 0, feed=None) -> None:
        """Stage the step's inputs; with a `feed` (`_feed_of`), then write the previous step's
        sampled ids (still on the device) into the slots that wait for them."""
        self.buffers.stage(batch, self.batch, pad_to=pad_to, feed=feed[:2] if feed else None)
        if feed:
            self.buffers.feed_tokens(len(feed[0]), feed[2])

    def _defer(self, batch: ScheduledBatch, ids: torch.Tensor, sampled_req_ids: list[str]) -> None:
        """Keep this step's sampled ids [R] on the device for the next step's feed, and start
        their copy to the host."""
        ids = ids.clone()                                                                       # [R]
        host, copied = self._host_ids[0]
        self._host_ids.reverse()
        host[:len(ids)].copy_(ids, non_blocking=True)
        if copied is not None:
            copied.record()
        where = {req_id: i for i, req_id in enumerate(batch.req_ids)}
        self._deferred = _DeferredTokens(list(batch.req_ids), {r: where[r] for r in sampled_req_ids},
                                         ids, host, copied)

    def _land(self, prev: _DeferredTokens | None, placeholders) -> ModelRunnerOutput | None:
        """Wait for the previous deferred step's ids and write them into their placeholders;
        that step's output on the driver (None without one)."""
        if prev is None:
            return None
        if prev.copied is not None:
            prev.copied.synchronize()
        tokens = prev.host[:len(prev.req_ids)].tolist()
        for req_id, pos in placeholders:
            row = self.batch.index.get(req_id)
            if row is not None:
                self.batch.token_ids[row, pos] = tokens[prev.sampled[req_id]]
        if not self.is_driver:
            return None
        return ModelRunnerOutput(req_ids=prev.req_ids, sampled_token_ids=[[t] for t in tokens])

    def forward_hidden(self, so: SchedulerOutput, taps: tuple[int, ...] = ()):
        """Apply one step and return the final hidden states of all its tokens [T, H] (with
        `taps`: also the tapped streams [T, len(taps) * H]), eager, no sampling: the model seen
        through the engine's own batch path, for tests and draft distillation."""
        with torch.inference_mode():
            self.batch.apply(so)
            batch = self.batch.schedule(so)
            hidden = self._eager(batch, None, taps)
            self.batch.advance(batch)
        return (hidden, self.step_taps) if taps else hidden

    def _graph_size(self, batch: ScheduledBatch | None, dp: DPStep | None) -> int | None:
        if self.graphs is None:
            return None
        if dp is not None:                      # the replicas decide together
            return self.graphs.padded_size(dp.num_reqs) if dp.all_decode else None
        return self.graphs.padded_size(batch.num_reqs) if batch.is_decode else None

    def _forward(self, batch: ScheduledBatch | None, dp: DPStep | None, feed=None):
        """-> (final hidden states [T, H], local logits [R, V_local] of each request's last
        token, argmax ids [R] or None when not computed yet)."""
        media = self._media_embeds(batch)
        b = None if media is not None else self._graph_size(batch, dp)
        if b is not None:
            self.num_graph_steps += 1
            self._stage(batch, pad_to=b, feed=feed)
            n = batch.num_reqs if batch is not None else 0
            return self.graphs.replay(b, n)
        self.num_eager_steps += 1
        hidden = self._eager(batch, dp, feed=feed, media=media)
        if batch is None:
            return hidden, None, None
        last = self.buffers.query_start_loc[1:batch.num_reqs + 1].long() - 1
        return hidden, self.model.lm_head.local_logits(hidden[last]), None

    def _eager(self, batch: ScheduledBatch | None, dp: DPStep | None, taps: tuple[int, ...] = (),
               feed=None, media=None) -> torch.Tensor:
        if batch is None:                       # a padding forward: one token on the null page
            self._stage(None, pad_to=1)
            n, t, decode, qsl, seq = 1, 1, True, [0, 1], [1]
        else:
            self._stage(batch, feed=feed)
            n, t, decode = batch.num_reqs, batch.num_tokens, batch.is_decode
            qsl, seq = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
        ids, positions, meta = self.buffers.inputs(
            n, t, decode, qsl, seq, dp_padded_tokens=dp.num_tokens if dp is not None else 0,
            record_selections=self.record_selections)
        embeds = None
        if media is not None:
            slots, feats = media
            embeds = self.model.model.embed_tokens(ids)
            embeds[slots] = feats.to(embeds.dtype)
        out = self.model(ids, positions, meta, taps, inputs_embeds=embeds)
        self.hidden, self.step_taps = out if taps else (out, None)
        self.step_inputs = (ids, positions, meta)
        return self.hidden

    # ------------------------------------------------------------ sampling

    def _complete(self, batch: ScheduledBatch) -> np.ndarray:
        """[R] bool: requests whose context is whole after this step (they sample; the others
        computed a partial prefill chunk)."""
        return batch.seq_lens >= self.batch.num_tokens[batch.rows]

    def _sample_on_device(self, batch: ScheduledBatch, local: torch.Tensor,
                          done: np.ndarray) -> torch.Tensor:
        """A deferred step's sampled ids [R] int64, left on the device (rows of partial prefill
        chunks hold 0 and are never read); done: [R] bool, the requests that sample (`_complete`).
        One rank only, and only requests that sample from the logits alone (the scheduler's
        rule), so no grammar, penalty or logprob work."""
        if self.model.tp.size > 1:
            raise RuntimeError("a deferred sampled step needs one rank (the ids feed every rank)")
        index, rows = np.flatnonzero(done), batch.rows[done].tolist()
        if any(not self.batch.params[r].samples_from_logits_alone for r in rows):
            raise RuntimeError("a deferred step has a request whose sampling reads its history")
        ids = torch.zeros(batch.num_reqs, dtype=torch.int64, device=local.device)
        if not rows:
            return ids
        out = self._draw(self.model.lm_head.gather(local), index, rows)
        ids[to_device(torch.from_numpy(index), local.device)] = out.sampled_token_ids
        return ids

    def _draw(self, logits: torch.Tensor, index: np.ndarray, rows: list[int]):
        """The sampler over the batch positions `index` (batch rows `rows`) of logits [R, V]."""
        b = self.batch
        params = [b.params[r] for r in rows]
        sampling = SamplingMetadata.from_params(
            params, [b.output_token_ids(r) for r in rows], [b.prompt_token_ids(r) for r in rows],
            [b.generators[r] for r in rows], self.vocab_size, self.device)
        picked = logits[to_device(torch.from_numpy(index), logits.device)]                # [R', V]
        if self.grammars is not None:
            self.grammars.mask(picked, [b.req_ids[r] for r in rows], params)
        return self.sampler(picked, sampling)

    def _sample(self, batch: ScheduledBatch, local: torch.Tensor, greedy: torch.Tensor | None):
        """-> (sampled ids per request, logprobs per request or None); empty on non-drivers.
        The logits gather and the distributed argmax are collectives: every rank calls them.

        Only requests whose context is complete after this step are sampled: a partial prefill
        chunk's token would be discarded, and drawing it would advance a seeded request's
        generator by a number of draws that depends on how its prompt was chunked."""
        head, b = self.model.lm_head, self.batch
        self.failed = {}
        done = self._complete(batch)                                      # [R]
        rows = batch.rows[done]
        if b.all_plain_greedy(rows):                  # the common benchmark case: argmax only
            if greedy is None:
                greedy = head.greedy(local)
            return (greedy.tolist() if self.is_driver else []), None
        logits = head.gather(local)                    # [R, V] fp32
        if not self.is_driver:
            return [], None
        sampled = [0] * batch.num_reqs                 # partial chunks: a placeholder, discarded
        logprobs = [None] * batch.num_reqs
        if not len(rows):
            return sampled, None
        index = np.flatnonzero(done)
        row_list = rows.tolist()
        params = [b.params[r] for r in row_list]
        req_ids = [b.req_ids[r] for r in row_list]
        out = self._draw(logits, index, row_list)
        for i, token in zip(index.tolist(), out.sampled_token_ids.tolist()):
            sampled[i] = token
        if self.grammars is not None:
            for req_id, p, token in zip(req_ids, params, out.sampled_token_ids.tolist()):
                if not self.grammars.accept(req_id, p, token):
                    self.failed[req_id] = ("its structured_outputs grammar reached a state that allows "
                                           "no token (no output can complete it)")
        if out.logprobs is None:
            return sampled, None
        for i, entry in zip(index.tolist(), self._sample_logprobs(out.logprobs, params)):
            logprobs[i] = entry
        return sampled, logprobs

    @staticmethod
    def _sample_logprobs(lp, params) -> list[list[LogprobEntry] | None]:
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

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> dict[str, list[LogprobEntry]]:
        """Logprobs of the prompt tokens this step's chunk predicts (position p predicts p + 1)."""
        out: dict[str, list[LogprobEntry]] = {}
        b, qsl = self.batch, batch.query_start_loc
        for i, row in enumerate(batch.rows.tolist()):
            k = b.params[row].prompt_logprobs
            if k is None:
                continue
            start = int(batch.seq_lens[i] - batch.num_scheduled[i])
            num_prompt = int(b.num_prompt_tokens[row])
            end = min(int(batch.seq_lens[i]), num_prompt - 1)   # last position predicting a prompt token
            if end <= start:
                out[batch.req_ids[i]] = []
                continue
            logits = self.model.compute_logits(hidden[qsl[i]:qsl[i] + end - start])   # collective
            if not self.is_driver:
                continue
            targets = torch.from_numpy(b.token_ids[row, start + 1:end + 1].astype(np.int64)).to(logits.device)
            lp = compute_logprobs(logits, targets, k)
            out[batch.req_ids[i]] = [
                (t, v, r, ids[:k], vals[:k]) for t, v, r, ids, vals in zip(
                    lp.token_ids.tolist(), lp.token_logprobs.tolist(), lp.token_ranks.tolist(),
                    lp.top_token_ids.tolist(), lp.top_logprobs.tolist())]
        return out

    # ------------------------------------------------------------ speculative decoding

    def _speculative_step(self, so: SchedulerOutput, batch: ScheduledBatch, dp: DPStep | None):
        """Verify each request's drafts (its last num_drafts + 1 positions get target logits),
        then propose the next drafts. Every rank samples (same generators and draws), so every
        rank knows the emitted tokens the proposer starts from."""
        from m3serve.spec.proposer import StepForDraft

        size = self._spec_graph_size(so, batch, dp)
        if size is not None:
            return self._speculative_graph_step(so, batch, size)
        b, R = self.batch, batch.num_reqs
        drafts = [so.scheduled_spec_decode_tokens.get(r, []) for r in batch.req_ids]
        num_drafts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=R)
        hidden = self._eager(batch, dp, self.proposer.taps)
        self.num_eager_steps += 1
        ends = batch.query_start_loc[1:].astype(np.int64)
        rows_per_req = num_drafts + 1
        row_start = np.cumsum(rows_per_req) - rows_per_req                  # [R] in `local`
        logit_rows = np.repeat(ends - rows_per_req - row_start, rows_per_req) + np.arange(rows_per_req.sum())
        local = self.model.lm_head.local_logits(hidden[torch.from_numpy(logit_rows).to(hidden.device)])
        done = self._complete(batch)
        emitted = self._verify(batch, local, row_start, num_drafts, drafts, done)
        # the proposer's start: each request's last verified position and the token after it
        num_emitted = np.fromiter((max(1, len(e)) for e in emitted), dtype=np.int64, count=R)
        last_index = ends - 1 - num_drafts + (num_emitted - 1)
        start_pos = batch.seq_lens.astype(np.int64) - batch.num_scheduled
        last_token = [e[-1] if e else int(b.token_ids[row, batch.seq_lens[i]])
                      for i, (e, row) in enumerate(zip(emitted, batch.rows.tolist()))]
        ids, positions, meta = self.step_inputs
        dev = hidden.device
        step = StepForDraft(
            input_ids=ids, positions=positions, meta=meta,
            hidden=self.step_taps if self.proposer.taps else hidden,
            last_index=torch.from_numpy(last_index).to(dev),
            last_token=torch.tensor(last_token, dtype=torch.int64, device=dev),
            last_position_cpu=(start_pos + last_index - batch.query_start_loc[:-1]).tolist(),
            block_tables=self.buffers.block_tables[:R])
        proposals = self.proposer.propose(step).tolist()
        return self._speculative_output(batch, emitted, proposals, done)

    def _speculative_output(self, batch: ScheduledBatch, emitted: list[list[int]], proposals: list[list[int]],
                            done) -> ModelRunnerOutput | None:
        self.batch.advance(batch)
        if not self.is_driver:
            return None
        spec = [proposals[i] if done[i] and self._can_draft(row, len(emitted[i])) else []
                for i, row in enumerate(batch.rows.tolist())]
        return ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=[e or [0] for e in emitted],
                                 spec_token_ids=spec)

    def _spec_graph_size(self, so: SchedulerOutput, batch: ScheduledBatch, dp: DPStep | None) -> int | None:
        """A graph step: no DP exchange, and every request verifies exactly k drafts."""
        g = self.spec_graphs
        if g is None or dp is not None or batch.num_tokens != batch.num_reqs * g.q:
            return None
        if any(len(so.scheduled_spec_decode_tokens.get(r, ())) != g.k for r in batch.req_ids):
            return None
        return g.padded_size(batch.num_reqs)

    def _speculative_graph_step(self, so: SchedulerOutput, batch: ScheduledBatch, b: int):
        """Verify and draft replays with acceptance decided on the device in between; one host
        sync for the emitted tokens and the next drafts."""
        g, n = self.spec_graphs, batch.num_reqs
        k, q = g.k, g.q
        self.num_graph_steps += 1
        self.buffers.stage(batch, self.batch, pad_to=b, pad_query_len=q)
        _, _, local, greedy, _ = g.verify(b)
        ids = self.buffers.token_ids[:b * q].view(b, q).long()
        if self.batch.all_plain_greedy(batch.rows) and self.rejection.method == "standard":
            emitted = greedy.view(b, q)
            kept = torch.cumprod((ids[:, 1:] == emitted[:, :k]).long(), dim=1).sum(dim=1)    # [b]
        else:
            b_rows, dev = self.batch, local.device
            rows = batch.rows.tolist()
            sampling = SamplingMetadata.from_params(
                [b_rows.params[r] for r in rows], [b_rows.output_token_ids(r) for r in rows],
                [b_rows.prompt_token_ids(r) for r in rows], [b_rows.generators[r] for r in rows],
                self.vocab_size, dev)
            logits = self.model.lm_head.gather(local[:n * q])                              # collective
            tokens, counts = self.rejection(logits, torch.arange(n, device=dev) * q,
                                            torch.full((n,), k, device=dev), ids[:n, 1:], sampling)
            emitted = torch.zeros(b, q, dtype=torch.int64, device=dev)
            kept = torch.zeros(b, dtype=torch.int64, device=dev)
            emitted[:n], kept[:n] = tokens.clamp_min(0), counts - 1
        g.last_index[:b].copy_(torch.arange(b, device=kept.device) * q + kept)
        g.last_token[:b].copy_(emitted.gather(1, kept[:, None])[:, 0])
        drafts = g.draft(b)
        kept_h, emitted_h, drafts_h = kept[:n].tolist(), emitted[:n].tolist(), drafts[:n].tolist()
        return self._speculative_output(batch, [e[:c + 1] for e, c in zip(emitted_h, kept_h)], drafts_h,
                                        [True] * n)

    def _can_draft(self, row: int, num_emitted: int) -> bool:
        """Drafts are verified by the plain rule: no penalties, no logprobs, min_tokens met."""
        b = self.batch
        outputs = int(b.num_tokens[row] - b.num_prompt_tokens[row]) + num_emitted
        p = b.params[row]
        return (p.logprobs is None and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
                and p.frequency_penalty == 0.0 and outputs >= p.min_tokens)

    def _verify(self, batch: ScheduledBatch, local: torch.Tensor, row_start: np.ndarray,
                num_drafts: np.ndarray, drafts: list[list[int]], done: np.ndarray) -> list[list[int]]:
        """-> emitted tokens per request ([] for partial prefill chunks)."""
        b, head = self.batch, self.model.lm_head
        rows = batch.rows.tolist()
        emitted: list[list[int]] = [[] for _ in rows]
        if b.all_plain_greedy(batch.rows[done]) and self.rejection.method == "standard":
            target = head.greedy(local).tolist()                              # collective
            for i, n in enumerate(num_drafts.tolist()):
                if not done[i]:
                    continue
                t = target[row_start[i]:row_start[i] + n + 1]
                kept = 0
                while kept < n and drafts[i][kept] == t[kept]:
                    kept += 1
                emitted[i] = t[:kept + 1]
            return emitted
        logits = head.gather(local)                                          # [N, V], collective
        plain = [i for i in range(len(rows)) if done[i] and num_drafts[i] == 0]
        verify = [i for i in range(len(rows)) if done[i] and num_drafts[i] > 0]
        dev = logits.device
        if plain:
            params = [b.params[rows[i]] for i in plain]
            sampling = SamplingMetadata.from_params(
                params, [b.output_token_ids(rows[i]) for i in plain], [b.prompt_token_ids(rows[i]) for i in plain],
                [b.generators[rows[i]] for i in plain], self.vocab_size, dev)
            out = self.sampler(logits[torch.tensor(row_start[plain], device=dev)], sampling)
            for i, token in zip(plain, out.sampled_token_ids.tolist()):
                emitted[i] = [token]
        if verify:
            params = [b.params[rows[i]] for i in verify]
            sampling = SamplingMetadata.from_params(
                params, [b.output_token_ids(rows[i]) for i in verify], [b.prompt_token_ids(rows[i]) for i in verify],
                [b.generators[rows[i]] for i in verify], self.vocab_size, dev)
            k = max(num_drafts[verify].max(), 1)
            padded = torch.tensor([drafts[i] + [0] * (k - len(drafts[i])) for i in verify], dtype=torch.int64,
                                  device=dev)
            tokens, counts = self.rejection(logits, torch.tensor(row_start[verify], device=dev),
                                            torch.tensor(num_drafts[verify], device=dev), padded, sampling)
            for i, t, c in zip(verify, tokens.tolist(), counts.tolist()):
                emitted[i] = t[:c]
        return emitted
