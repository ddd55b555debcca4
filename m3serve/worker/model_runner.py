"""The model runner of one rank: `execute_model(scheduler_output)` = apply the diff to the
persistent input batch -> stage the step's inputs (one copy) -> forward (CUDA-graph replay for
pure decode, eager otherwise) -> the step sampler (`worker/step_sampler.py`: sampling,
verification, logprobs) -> `ModelRunnerOutput`. With a proposer, the drafts of the next step
are proposed after the verification.

Every rank of a TP group runs the same steps on the same batch state and takes the same
decisions (graph or eager, argmax or full logits, which prompt logprobs), so the collectives
inside line up; only the driver (TP rank 0) samples and returns tokens. Sampled tokens reach
the other ranks as the next step's `new_token_ids`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from m3serve.core.sampling_mode import SamplingMode
from m3serve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from m3serve.layers.dispatch import use_triton
from m3serve.worker.attn_metadata import StepBuffers
from m3serve.worker.cuda_graphs import DecodeGraphs
from m3serve.worker.input_batch import InputBatch, ScheduledBatch
from m3serve.worker.step_sampler import StepSampler


@dataclass
class EagerForward:
    """What one eager target forward produced, handed on to verification and drafting."""
    hidden: torch.Tensor               # [T, H] final hidden states
    taps: torch.Tensor | None          # [T, len(taps) * H] tapped residual streams, or None
    input_ids: torch.Tensor            # [T] the staged inputs the forward read
    positions: torch.Tensor            # [T] int64
    meta: object                       # layers.attention_metadata.AttentionMetadata


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
                 seed: int = 0, is_driver: bool = True, extra_positions: int = 0, draft_tables: bool = False,
                 *, vision=None, proposer=None, rejection=None, grammars=None,
                 spec_graph_sizes: list[int] = (), spec_graph_widths: list[int] = ()):
        """Everything a step needs, whole: the paged caches of `num_blocks` blocks and the step
        buffers for up to `max_num_reqs` requests and `max_num_tokens` tokens. With a vision
        tower `vision` (model.vision.VisionEncoder) its outputs' store is made here; with a draft
        `proposer` (spec_decode.proposer.Proposer, its caches allocated) every rank samples,
        `rejection` (worker.rejection.RejectionSampler) verifies its drafts, and on a GPU the
        speculative decode graphs for `spec_graph_sizes` x `spec_graph_widths` are made (captured
        by `spec_graphs.capture`). `grammars` (structured.compiler.GrammarBook) masks the
        sampling rank's constrained requests."""
        self.model, self.cfg = model, model.cfg
        self.block_size, self.num_blocks, self.device = block_size, num_blocks, device
        self.max_model_len = max_model_len
        self.is_driver = is_driver
        self.vocab_size = self.cfg.vocab_size
        # every rank samples when speculating (the proposer starts from the emitted tokens)
        samples = is_driver or proposer is not None
        self.batch = InputBatch(max_model_len, block_size, device, capacity=max_num_reqs,
                                make_generators=samples, extra_positions=extra_positions,
                                draft_tables=draft_tables)
        self.buffers = StepBuffers(max_num_reqs, max_num_tokens, self.batch.max_blocks, block_size, device,
                                   draft_tables=draft_tables)
        self.step_sampler = StepSampler(model, self.batch, device, max_num_reqs, is_driver, samples, seed,
                                        grammars=grammars, rejection=rejection)
        self.kv_cache_dtype = kv_cache_dtype or model.dtype
        self.index_cache_dtype = index_cache_dtype or model.dtype
        self.dp_exchange = model.parallel.dp.active
        self.graphs: DecodeGraphs | None = None
        self.proposer = proposer
        self.vision = vision
        self.media: dict = {}         # request id -> worker.media.MediaFeatures
        self.encoder_outputs = None   # worker.media.EncoderOutputs, with the vision encoder
        if vision is not None:
            from m3serve.worker.media import EncoderOutputs
            self.encoder_outputs = EncoderOutputs(model.dtype)
        self.spec_graphs = None       # worker.spec_graphs.SpecDecodeGraphs, with the proposer on a GPU
        if proposer is not None and spec_graph_sizes:
            from m3serve.worker.spec_graphs import SpecDecodeGraphs
            self.spec_graphs = SpecDecodeGraphs(model, proposer, self.buffers, list(spec_graph_sizes),
                                                extra_positions, max_model_len, list(spec_graph_widths))
        self.num_graph_steps = self.num_eager_steps = 0
        self._allocate_caches()

    def _allocate_caches(self) -> None:
        cfg, bs = self.cfg, self.block_size
        attn = self.model.attention_layers
        self.kv_caches = [torch.zeros(2, self.num_blocks, bs, a.num_kv_heads, cfg.head_dim,
                                      dtype=self.kv_cache_dtype, device=self.device) for a in attn]
        self.index_caches = [torch.zeros(self.num_blocks, bs, cfg.index_head_dim, dtype=self.index_cache_dtype,
                                         device=self.device) if a.computes_index else None for a in attn]
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
        self._warm_up_attention_splits()
        self.step_sampler.warm_up()

    def _warm_up_attention_splits(self) -> None:
        """Every split count of the per-token attention kernel for each layer configuration of
        the target and the draft: eager verify and draft steps pick counts by their sizes."""
        from m3serve.kernels.paged_attention import warm_up_token_kernel
        if not use_triton("attention", self.model.lm_head.weight):
            return
        configs = [(a.num_heads, a.kv_cache, a.is_sparse, False, a.k_scale, a.v_scale)
                   for a in self.model.attention_layers]
        if self.proposer is not None:
            configs += self.proposer.drafter.attention_kernels()
        seen = set()
        for heads, cache, sparse, key_lo, k_scale, v_scale in configs:
            key = (heads, tuple(cache.shape[2:]), cache.dtype, sparse, key_lo)
            if key in seen:
                continue
            seen.add(key)
            warm_up_token_kernel(heads, cache, self.model.dtype, sparse=sparse, key_lo=key_lo,
                                 k_scale=k_scale, v_scale=v_scale)

    # ------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, dp: DPStep | None = None) -> ModelRunnerOutput | None:
        """One step. `dp` is set when the MoE layers exchange tokens with other DP replicas:
        then a step without requests still runs a padding forward. Returns None on ranks that
        do not sample.

        Async scheduling: a `deferred` step leaves its sampled ids on the device and returns no
        tokens; the next call takes them as its inputs (placeholders the scheduler counted),
        launches its own forward, and only then waits for them, returning them as `previous`."""
        sampler = self.step_sampler
        if (so.speculate and so.propose and so.num_scheduled_tokens and self.proposer is not None
                and sampler.deferred is not None):
            # (checked before anything changes: the scheduler lands a deferred step first)
            raise RuntimeError("a step with drafts follows a deferred step whose tokens have not landed")
        sampler.drop(so.finished_req_ids)
        self._track_media(so)
        prev = sampler.take_deferred()
        placeholders = self.batch.apply(so, prev.sampled if prev is not None else ())
        if not so.num_scheduled_tokens:
            if dp is not None:
                self._forward(None, dp)
            previous = sampler.land(prev, placeholders)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], previous=previous) if self.is_driver else None
        batch = self.batch.schedule(so)
        if self.proposer is not None and so.speculate:
            if not so.propose:
                return self._write_only_step(so, batch, dp, prev, placeholders)
            return self._speculative_step(so, batch, dp)
        feed = prev.feed(batch, placeholders) if prev is not None else None
        hidden, local, greedy = self._forward(batch, dp, feed)
        out = sampler.sample_step(so, batch, prev, placeholders, hidden, local, greedy)
        self.batch.advance(batch)
        return out

    # ------------------------------------------------------------ images and videos

    def _track_media(self, so: SchedulerOutput) -> None:
        if so.encoder_cache_frees and self.encoder_outputs is not None:
            self.encoder_outputs.free(so.encoder_cache_frees)
        for req_id in so.finished_req_ids:
            self.media.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.mm_inputs:
                from m3serve.worker.media import MediaFeatures
                self.media[new.req_id] = MediaFeatures(new.prompt_token_ids, new.mm_inputs,
                                                       self.cfg.image_token_id, self.cfg.video_token_id)

    def _media_embeds(self, batch: ScheduledBatch | None, shift: int = 0):
        """(step token slots [k], features [k, H]) of the placeholders this step computes, or
        None. First the store gets what the step's requests need, in one encoder forward (a
        request may read an output that another one encodes in this step), then the rows are
        gathered. With `shift` 1: of the placeholders one position ahead, i.e. slot t gets the
        features of position t + 1 (what EAGLE3 and MTP embed at row t), the chunk's last row
        included: its look-ahead is the next chunk's first position, which the scheduler's
        encoder plan covers."""
        if batch is None or not self.media:
            return None
        slots, rows = [], []
        start = batch.seq_lens - batch.num_scheduled + shift               # [R]
        ranges = [(self.media.get(req_id), int(start[i]), int(batch.seq_lens[i]) + shift)
                  for i, req_id in enumerate(batch.req_ids)]
        from m3serve.worker.media import encode_step
        encode_step([r for r in ranges if r[0] is not None], self.vision, self.encoder_outputs)
        for i, (media, first, end) in enumerate(ranges):
            if media is None:
                continue
            found = media.rows(first, end, self.encoder_outputs)
            if found is not None:
                offsets, feats = found
                slots.append(torch.from_numpy(offsets + int(batch.query_start_loc[i])))
                rows.append(feats)
        if not slots:
            return None
        return torch.cat(slots).to(self.device), torch.cat(rows)

    # ------------------------------------------------------------ the forward

    def _stage(self, batch: ScheduledBatch | None, pad_to: int = 0, feed=None) -> None:
        """Stage the step's inputs; with a `feed` (`DeferredTokens.feed`), then write the
        previous step's sampled ids (still on the device) into the slots that wait for them."""
        self.buffers.stage(batch, self.batch, pad_to=pad_to, feed=feed[:2] if feed else None)
        if feed:
            self.buffers.feed_tokens(len(feed[0]), feed[2])

    def forward_hidden(self, so: SchedulerOutput, taps: tuple[int, ...] = ()):
        """Apply one step and return the final hidden states of all its tokens [T, H] (with
        `taps`: also the tapped streams [T, len(taps) * H]), eager, no sampling: the model seen
        through the engine's own batch path, for tests and draft distillation."""
        with torch.inference_mode():
            self.batch.apply(so)
            batch = self.batch.schedule(so)
            fwd = self._eager(batch, None, taps)
            self.batch.advance(batch)
        return (fwd.hidden, fwd.taps) if taps else fwd.hidden

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
        hidden = self._eager(batch, dp, feed=feed, media=media).hidden
        if batch is None:
            return hidden, None, None
        return hidden, self._last_logits(hidden, batch), None

    def _last_logits(self, hidden: torch.Tensor, batch: ScheduledBatch) -> torch.Tensor:
        """This rank's logits [R, V_local] of each request's last token of an eager step."""
        last = self.buffers.query_start_loc[1:batch.num_reqs + 1].long() - 1
        return self.model.lm_head.local_logits(hidden[last])

    def _eager(self, batch: ScheduledBatch | None, dp: DPStep | None, taps: tuple[int, ...] = (),
               feed=None, media=None) -> EagerForward:
        if batch is None:                       # a padding forward: one token on the null page
            self._stage(None, pad_to=1)
            n, t, decode, qsl, seq = 1, 1, True, [0, 1], [1]
        else:
            self._stage(batch, feed=feed)
            n, t, decode = batch.num_reqs, batch.num_tokens, batch.is_decode
            qsl, seq = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
        ids, positions, meta = self.buffers.inputs(
            n, t, decode, qsl, seq, dp_padded_tokens=dp.num_tokens if dp is not None else 0)
        embeds = None
        if media is not None:
            slots, feats = media
            embeds = self.model.model.embed_tokens(ids)
            embeds[slots] = feats.to(embeds.dtype)
        out = self.model(ids, positions, meta, taps, inputs_embeds=embeds)
        hidden, tapped = out if taps else (out, None)
        return EagerForward(hidden, tapped, ids, positions, meta)

    # ------------------------------------------------------------ speculative decoding

    def _speculative_step(self, so: SchedulerOutput, batch: ScheduledBatch, dp: DPStep | None):
        """Verify each request's drafts (its last num_drafts + 1 positions get target logits),
        then propose the next drafts. Every rank samples (same generators and draws), so every
        rank knows the emitted tokens the proposer starts from."""
        media = self._media_embeds(batch)
        size = self._spec_graph_size(so, batch, dp) if media is None else None
        if size is not None:
            return self._speculative_graph_step(so, batch, *size)
        drafts = [so.scheduled_spec_decode_tokens.get(r, []) for r in batch.req_ids]
        fwd = self._eager(batch, dp, self.proposer.taps, media=media)
        self.num_eager_steps += 1
        verified = self.step_sampler.verify(so, batch, fwd.hidden, drafts)
        start = self._draft_start(batch, fwd, verified.emitted, verified.num_drafts,
                                  self._media_embeds(batch, shift=1))
        proposals = self.proposer.propose(start).tolist()
        self.batch.advance(batch)
        return self.step_sampler.speculative_output(so, batch, verified.emitted, proposals, verified.done,
                                                    verified.logprobs, verified.prompt_logprobs)

    def _write_only_step(self, so: SchedulerOutput, batch: ScheduledBatch, dp: DPStep | None,
                         prev, placeholders):
        """A plain step that also runs the draft over its tokens, writing the draft's KV and
        proposing nothing (`SchedulerOutput.propose` False: the gate chose plain steps while
        prompt tokens are due, and the draft must hold the prompt for later drafts). It samples
        -- or, `so.deferred`, leaves its ids on the device -- as a plain step does, so it may
        follow a deferred step and be deferred itself: the draft reads the sampled ids on the
        device."""
        media = self._media_embeds(batch)
        feed = prev.feed(batch, placeholders) if prev is not None else None
        fwd = self._eager(batch, dp, self.proposer.taps, feed=feed, media=media)
        self.num_eager_steps += 1
        sampler = self.step_sampler
        out = sampler.sample_step(so, batch, prev, placeholders, fwd.hidden, self._last_logits(fwd.hidden, batch),
                                  None)
        R = batch.num_reqs
        start = self._draft_start(batch, fwd, [[]] * R, np.zeros(R, dtype=np.int64),
                                  self._media_embeds(batch, shift=1),
                                  sampled=(sampler.step_ids_on_device(), sampler.complete(batch)))
        self.proposer.write_only(start)
        self.batch.advance(batch)
        return out

    def _draft_start(self, batch: ScheduledBatch, fwd: EagerForward, emitted: list[list[int]],
                     num_drafts: np.ndarray, next_media=None, sampled=None):
        """The proposer's start: each request's last verified position and the token after it.
        `emitted` [R]: each request's accepted drafts and the token after them ([] for partial
        chunks), `num_drafts` [R] the drafts it verified; `next_media` (`_media_embeds(batch,
        shift=1)`): the rows whose next token is an image or video placeholder and its features;
        `sampled` (ids [R] on the device, done [R] bool): a plain step's sampled ids, the token
        after the last position of each request that sampled (`emitted` all [])."""
        from m3serve.spec_decode.proposer import StepForDraft

        R = batch.num_reqs
        ends = batch.query_start_loc[1:].astype(np.int64)
        num_emitted = np.fromiter((max(1, len(e)) for e in emitted), dtype=np.int64, count=R)
        last_index = ends - 1 - num_drafts + (num_emitted - 1)
        start_pos = batch.seq_lens.astype(np.int64) - batch.num_scheduled
        # (a request that sampled has no token at seq_len yet: read, then replaced below)
        width = self.batch.token_ids.shape[1]
        last_token = [e[-1] if e else int(self.batch.token_ids[row, min(int(batch.seq_lens[i]), width - 1)])
                      for i, (e, row) in enumerate(zip(emitted, batch.rows.tolist()))]
        dev = fwd.hidden.device
        last_token = torch.tensor(last_token, dtype=torch.int64, device=dev)
        if sampled is not None:
            ids, done = sampled
            last_token = torch.where(torch.from_numpy(done).to(dev), ids[:R].to(dev), last_token)
        return StepForDraft(
            input_ids=fwd.input_ids, positions=fwd.positions, meta=fwd.meta,
            hidden=fwd.taps if self.proposer.taps else fwd.hidden,
            last_index=torch.from_numpy(last_index).to(dev),
            last_token=last_token,
            last_position_cpu=(start_pos + last_index - batch.query_start_loc[:-1]).tolist(),
            block_tables=self.buffers.block_tables[:R],
            draft_block_tables=self._rows_of(self.buffers.draft_block_tables, R),
            draft_valid_from=self._rows_of(self.buffers.draft_valid_from, R),
            next_media=next_media, context_rows=self._window_rows(batch, dev))

    def _window_rows(self, batch: ScheduledBatch, dev: torch.device) -> torch.Tensor | None:
        """A window draft's `StepForDraft.context_rows`: of each request, the rows at positions
        from the first block of its window after the step (`core/kv_cache/draft_window.py`: lo =
        c' - k - W + 1, c' the tokens computed after it); None when that is every row (decode and
        verify steps, prompt chunks inside the window) or the draft reads its whole context."""
        window = self.proposer.drafter.sliding_window
        if not window:
            return None
        bs = self.proposer.block_size
        end = batch.seq_lens.astype(np.int64)                                   # c' [R]
        start = end - batch.num_scheduled
        keep_from = np.maximum(0, end - self.proposer.k - window + 1) // bs * bs
        skip = np.clip(keep_from - start, 0, batch.num_scheduled)
        if not skip.any():
            return None
        qsl = batch.query_start_loc.astype(np.int64)
        rows = np.concatenate([np.arange(qsl[i] + skip[i], qsl[i + 1]) for i in range(batch.num_reqs)])
        return torch.from_numpy(rows).to(dev)

    @staticmethod
    def _rows_of(view, n: int):
        return view[:n] if view is not None else None

    def _spec_graph_size(self, so: SchedulerOutput, batch: ScheduledBatch,
                         dp: DPStep | None) -> tuple[int, int] | None:
        """(capture size, query width) of a graph step, or None: no DP exchange, every request
        verifies the same number of drafts j and samples a decode (no prompt chunk, no
        logprobs, prompt logprobs, penalties or logit bias: the graph step computes none), and
        a graph of query width j + 1 was captured."""
        g = self.spec_graphs
        if g is None or dp is not None:
            return None
        spec = so.scheduled_spec_decode_tokens
        q = len(spec.get(batch.req_ids[0], ())) + 1
        if q not in g.widths or batch.num_tokens != batch.num_reqs * q:
            return None
        if any(len(spec.get(r, ())) != q - 1 for r in batch.req_ids):
            return None
        if q == 1 and (not self.step_sampler.complete(batch).all()
                       or not (batch.seq_lens > self.batch.num_prompt_tokens[batch.rows]).all()
                       or (self.step_sampler.modes(so, batch) == SamplingMode.FULL).any()):
            return None      # (a request with drafts always samples a decode, never in FULL mode)
        b = g.padded_size(batch.num_reqs)
        return None if b is None else (b, q)

    def _speculative_graph_step(self, so: SchedulerOutput, batch: ScheduledBatch, b: int, q: int):
        """Verify and draft replays (b requests padded, q tokens each) with acceptance decided
        on the device in between; one host sync for the emitted tokens and the next drafts.
        Constrained requests' grammar masks depend only on the host's drafts: they are filled
        and copied before the verify replay and applied to its logits on the device."""
        g, n = self.spec_graphs, batch.num_reqs
        self.num_graph_steps += 1
        verified = [so.scheduled_spec_decode_tokens.get(r, []) for r in batch.req_ids]
        masks = self.step_sampler.grammar_masks(so, batch, np.ones(n, dtype=bool), verified,
                                                np.arange(n) * q, n * q)
        self.buffers.stage(batch, self.batch, pad_to=b, pad_query_len=q)
        _, _, local, greedy, _ = g.verify(b, q, n)
        ids = self.buffers.token_ids[:b * q].view(b, q).long()
        emitted, kept = self.step_sampler.verify_on_device(so, batch, local, greedy, ids, q - 1, masks)
        g.last_index[:b].copy_(torch.arange(b, device=kept.device) * q + kept)
        g.last_token[:b].copy_(emitted.gather(1, kept[:, None])[:, 0])
        drafts = g.draft(b, q, n)
        kept_h, emitted_h, drafts_h = kept[:n].tolist(), emitted[:n].tolist(), drafts[:n].tolist()
        self.batch.advance(batch)
        return self.step_sampler.speculative_output(so, batch, [e[:c + 1] for e, c in zip(emitted_h, kept_h)],
                                                    drafts_h, [True] * n)
