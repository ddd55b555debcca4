"""The step sampler: everything a step does after the target's forward, on the rank(s) that
sample. Plain sampling (argmax-only or the full sampler, with grammar masks), on-device deferred
sampling for async scheduling, verification of drafts (eager, and on the device between the
speculative graphs' replays), output logprobs and prompt logprobs.

It reads the persistent input batch (params, generators, token history) but never changes its
shape; it writes only the tokens a deferred step leaves on the device into their placeholder
slots. Which path a request takes is its `SamplingMode`, decided by the scheduler and read from
the `SchedulerOutput`, never re-derived here. The logits gather and the distributed argmax are
collectives, so every rank of a TP group calls the same methods in the same order; only the
driver builds outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from m3serve.core.sampling_mode import SamplingMode
from m3serve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from m3serve.worker.input_batch import InputBatch, ScheduledBatch
from m3serve.worker.sampler import (Sampler, SamplingMetadata, apply_top_k_top_p, compute_logprobs,
                                    to_device)

# per position: (token id, its logprob, its rank, top-n ids, top-n logprobs)
LogprobEntry = tuple[int, float, int, list[int], list[float]]

GRAMMAR_DEAD_END = ("its structured_outputs grammar reached a state that allows no token "
                    "(no output can complete it)")


@dataclass
class DeferredTokens:
    """A deferred step's sampled ids (async scheduling): on the device for the next step's
    inputs, and on their way to a pinned host buffer for the output."""
    req_ids: list[str]            # the step's requests, in batch order
    sampled: dict[str, int]       # request id -> index of its real token (complete contexts)
    device: torch.Tensor          # [R] int64
    host: torch.Tensor            # [>= R] int64, pinned on a GPU
    copied: object                # torch.cuda.Event, or None on CPU

    def feed(self, batch: ScheduledBatch, placeholders):
        """(this step's token slots, their sources in these ids, these device ids) for the
        placeholders `batch` reads, or None: what `StepBuffers.stage` writes on the device."""
        if not placeholders:
            return None
        where = {req_id: i for i, req_id in enumerate(batch.req_ids)}
        start = batch.seq_lens - batch.num_scheduled                       # [R]
        slots, sources = [], []
        for req_id, pos in placeholders:
            i = where.get(req_id)
            if i is not None and start[i] <= pos < batch.seq_lens[i]:
                slots.append(int(batch.query_start_loc[i]) + pos - int(start[i]))
                sources.append(self.sampled[req_id])
        if not slots:
            return None
        return np.asarray(slots, dtype=np.int32), np.asarray(sources, dtype=np.int32), self.device


@dataclass
class Verified:
    """One eager verify step's outcome, per request in batch order."""
    emitted: list[list[int]]      # accepted drafts + the token after them; [] for partial chunks
    num_drafts: np.ndarray        # [R] int64 drafts each request verified
    done: np.ndarray              # [R] bool requests whose context is whole after the step
    logprobs: list | None = None  # per request its sampled token's entries (FULL rows), or None
    prompt_logprobs: dict | None = None


class StepSampler:
    """Samples one step's tokens from the forward's logits and builds its output."""

    def __init__(self, model, batch: InputBatch, device: torch.device, max_num_reqs: int,
                 is_driver: bool, samples: bool, seed: int = 0, *, grammars=None, rejection=None):
        self.model, self.batch, self.device = model, batch, device
        self.head = model.lm_head
        self.vocab_size = model.cfg.vocab_size
        self.is_driver = is_driver
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed)) if samples else None
        self.grammars = grammars      # structured.compiler.GrammarBook on the sampling rank
        self.rejection = rejection    # worker.rejection.RejectionSampler when speculating
        self.failed: dict[str, str] = {}   # the last sampled step's requests that cannot go on: why
        self.deferred: DeferredTokens | None = None
        # the last `sample_step`'s ids [R] (rows that did not sample: any value), on the device
        # or as a host list; `step_ids_on_device()` for a draft pass after a plain step
        self.step_ids: torch.Tensor | list[int] | None = None
        # async scheduling: two pinned buffers (each with its copy's event), used in turn, so a
        # step's copy never overwrites the one being read
        cuda = device.type == "cuda"
        self._host_ids = [(torch.zeros(max_num_reqs, dtype=torch.int64, pin_memory=cuda),
                           torch.cuda.Event() if cuda else None) for _ in range(2)]

    def step_ids_on_device(self) -> torch.Tensor:
        """The last `sample_step`'s ids [R] int64 on the device (no host sync where they were
        sampled there)."""
        ids = self.step_ids
        if ids is None:
            raise RuntimeError("no step has been sampled")
        if isinstance(ids, list):
            return torch.tensor(ids, dtype=torch.int64, device=self.device)
        return ids.long()

    def warm_up(self) -> None:
        """Compile the top-k / top-p cut-off kernels (one variant each)."""
        if self.sampler is not None:
            logits = torch.zeros(1, self.vocab_size, device=self.device)
            apply_top_k_top_p(logits, torch.ones(1, dtype=torch.int64, device=self.device),
                              torch.full((1,), 0.5, device=self.device), 1)

    def drop(self, finished_req_ids) -> None:
        if self.grammars is not None:
            for req_id in finished_req_ids:
                self.grammars.drop(req_id)

    @staticmethod
    def modes(so: SchedulerOutput, batch: ScheduledBatch) -> np.ndarray:
        """[R] int: each scheduled request's `SamplingMode`, as the scheduler sent it."""
        missing = [r for r in batch.req_ids if r not in so.sampling_modes]
        if missing:
            raise RuntimeError(f"the scheduler output has no sampling mode for requests {missing}")
        return np.fromiter((so.sampling_modes[r] for r in batch.req_ids), dtype=np.int64, count=batch.num_reqs)

    def complete(self, batch: ScheduledBatch) -> np.ndarray:
        """[R] bool: requests whose context is whole after this step (they sample; the others
        computed a partial prefill chunk)."""
        return batch.seq_lens >= self.batch.num_tokens[batch.rows]

    def metadata(self, rows: list[int]) -> SamplingMetadata:
        """The step's sampling metadata over these batch rows (built once per step)."""
        b = self.batch
        return SamplingMetadata.from_params(
            [b.params[r] for r in rows], [b.output_token_ids(r) for r in rows],
            [b.prompt_token_ids(r) for r in rows], [b.generators[r] for r in rows],
            self.vocab_size, self.device)

    # ------------------------------------------------------------ one-token steps

    def sample_step(self, so: SchedulerOutput, batch: ScheduledBatch, prev: DeferredTokens | None,
                    placeholders, hidden: torch.Tensor, local: torch.Tensor,
                    greedy: torch.Tensor | None) -> ModelRunnerOutput | None:
        """Sample a one-token step (or, `so.deferred`, leave its ids on the device) and land the
        previous deferred step's ids. -> the output on the driver, None elsewhere."""
        done = self.complete(batch)                                          # [R]
        modes = self.modes(so, batch)[done]                                  # the requests that sample
        argmax = bool((modes == SamplingMode.ARGMAX).all())
        if so.deferred:
            if argmax:
                self.step_ids = greedy if greedy is not None else self.head.greedy(local)
                self._defer(batch, self.step_ids, so.sampled_req_ids)
                previous = self.land(prev, placeholders)
            else:   # sampled on the device; the previous ids land first: the history is whole
                if not np.isin(modes, (SamplingMode.ARGMAX, SamplingMode.LOGITS)).all():
                    raise RuntimeError("a deferred step has a request whose sampling reads more than its logits")
                previous = self.land(prev, placeholders)
                self.step_ids = self._sample_on_device(batch, local, done)
                self._defer(batch, self.step_ids, so.sampled_req_ids)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], previous=previous) if self.is_driver else None
        previous = self.land(prev, placeholders)       # before sampling: the host history is whole
        sampled, logprobs = self._sample(batch, local, greedy, done, argmax)
        prompt_logprobs = self._prompt_logprobs(batch, hidden)
        if not self.is_driver:
            return None
        return ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=[[t] for t in sampled],
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs, failed=self.failed,
                                 previous=previous)

    def _sample(self, batch: ScheduledBatch, local: torch.Tensor, greedy: torch.Tensor | None,
                done: np.ndarray, argmax: bool):
        """-> (sampled ids per request, logprobs per request or None); empty on non-drivers.
        done: [R] bool, the requests that sample; argmax: every one of them is ARGMAX.

        Only requests whose context is complete after this step are sampled: a partial prefill
        chunk's token would be discarded, and drawing it would advance a seeded request's
        generator by a number of draws that depends on how its prompt was chunked."""
        b = self.batch
        self.failed = {}
        rows = batch.rows[done]
        if argmax:                                     # the common benchmark case: argmax only
            if greedy is None:
                greedy = self.head.greedy(local)
            self.step_ids = greedy
            return (greedy.tolist() if self.is_driver else []), None
        logits = self.head.gather(local)               # [R, V] fp32
        if self.sampler is None:
            return [], None
        # every rank that samples draws (when speculating, all do: their generators must stay
        # in step for the verify steps), only the driver reports
        sampled = [0] * batch.num_reqs                 # partial chunks: a placeholder, discarded
        logprobs = [None] * batch.num_reqs
        self.step_ids = sampled                        # (a device tensor only when asked for)
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
                    self.failed[req_id] = GRAMMAR_DEAD_END
        if not self.is_driver:
            return [], None
        if out.logprobs is None:
            return sampled, None
        for i, entry in zip(index.tolist(), _logprob_entries(out.logprobs, params)):
            logprobs[i] = entry
        return sampled, logprobs

    def _draw(self, logits: torch.Tensor, index: np.ndarray, rows: list[int]):
        """The sampler over the batch positions `index` (batch rows `rows`) of logits [R, V],
        with each constrained row's grammar mask applied first."""
        sampling = self.metadata(rows)
        picked = logits[to_device(torch.from_numpy(index), logits.device)]                # [R', V]
        if self.grammars is not None:
            b = self.batch
            self.grammars.mask(picked, [b.req_ids[r] for r in rows], [b.params[r] for r in rows])
        return self.sampler(picked, sampling)

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

    # ------------------------------------------------------------ async scheduling

    def take_deferred(self) -> DeferredTokens | None:
        """The previous step's deferred ids (None if it was not deferred); forgotten here."""
        prev, self.deferred = self.deferred, None
        return prev

    def _sample_on_device(self, batch: ScheduledBatch, local: torch.Tensor, done: np.ndarray) -> torch.Tensor:
        """A deferred step's sampled ids [R] int64, left on the device (rows of partial prefill
        chunks hold 0 and are never read); done: [R] bool, the requests that sample.
        One rank only, and only LOGITS / ARGMAX requests, so no grammar, penalty or logprob work."""
        if self.model.tp.size > 1:
            raise RuntimeError("a deferred sampled step needs one rank (the ids feed every rank)")
        index, rows = np.flatnonzero(done), batch.rows[done].tolist()
        ids = torch.zeros(batch.num_reqs, dtype=torch.int64, device=local.device)
        if not rows:
            return ids
        out = self._draw(self.head.gather(local), index, rows)
        ids[to_device(torch.from_numpy(index), local.device)] = out.sampled_token_ids
        return ids

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
        self.deferred = DeferredTokens(list(batch.req_ids), {r: where[r] for r in sampled_req_ids},
                                       ids, host, copied)

    def land(self, prev: DeferredTokens | None, placeholders) -> ModelRunnerOutput | None:
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

    # ------------------------------------------------------------ verification

    def grammar_masks(self, so: SchedulerOutput, batch: ScheduledBatch, done: np.ndarray,
                      drafts: list[list[int]], first_rows, num_rows: int):
        """The grammar masks of a verify step's logits [num_rows, V] (`GrammarBook.verify_masks`):
        request i's verified positions are rows first_rows[i] .. first_rows[i] + len(drafts[i]).
        Only requests that sample (`done` [R] bool) in a mode that applies a grammar (GRAMMAR,
        or FULL, whose rows verify no drafts) get them; None when there are none. Built from the
        host's drafts alone, so the graph step fills them before its verify replay."""
        if self.grammars is None:
            return None
        modes = self.modes(so, batch)
        picked = np.flatnonzero(done & np.isin(modes, (SamplingMode.GRAMMAR, SamplingMode.FULL))).tolist()
        if not picked:
            return None
        b, rows = self.batch, batch.rows.tolist()
        return self.grammars.verify_masks(num_rows, [b.req_ids[rows[i]] for i in picked],
                                          [b.params[rows[i]] for i in picked], [drafts[i] for i in picked],
                                          [int(first_rows[i]) for i in picked], self.device)

    def verify(self, so: SchedulerOutput, batch: ScheduledBatch, hidden: torch.Tensor,
               drafts: list[list[int]]) -> Verified:
        """Eager verification: the target's logits at each request's last num_drafts + 1
        positions of `hidden` [T, H] (masked by the grammar of constrained requests) decide which
        drafts it keeps and the token after them."""
        R = batch.num_reqs
        num_drafts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=R)
        ends = batch.query_start_loc[1:].astype(np.int64)
        rows_per_req = num_drafts + 1
        row_start = np.cumsum(rows_per_req) - rows_per_req                  # [R] in `local`
        logit_rows = np.repeat(ends - rows_per_req - row_start, rows_per_req) + np.arange(rows_per_req.sum())
        local = self.head.local_logits(hidden[torch.from_numpy(logit_rows).to(hidden.device)])
        done = self.complete(batch)
        argmax = bool((self.modes(so, batch)[done] == SamplingMode.ARGMAX).all())
        masks = None if argmax else self.grammar_masks(so, batch, done, drafts, row_start, len(local))
        emitted, logprobs = self._emitted(batch, local, row_start, num_drafts, drafts, done, argmax, masks)
        return Verified(emitted, num_drafts, done, logprobs, self._prompt_logprobs(batch, hidden))

    def _emitted(self, batch: ScheduledBatch, local: torch.Tensor, row_start: np.ndarray,
                 num_drafts: np.ndarray, drafts: list[list[int]], done: np.ndarray,
                 argmax: bool, masks) -> tuple[list[list[int]], list | None]:
        """-> (emitted tokens per request ([] for partial prefill chunks), the logprob entries of
        requests that verified no draft and asked for them, or None); masks: the step's
        `grammar_masks` or None."""
        head = self.head
        rows = batch.rows.tolist()
        emitted: list[list[int]] = [[] for _ in rows]
        if argmax and self.rejection.method == "standard":
            target = head.greedy(local).tolist()                              # collective
            for i, n in enumerate(num_drafts.tolist()):
                if not done[i]:
                    continue
                t = target[row_start[i]:row_start[i] + n + 1]
                kept = 0
                while kept < n and drafts[i][kept] == t[kept]:
                    kept += 1
                emitted[i] = t[:kept + 1]
            return emitted, None
        logits = head.gather(local)                                          # [N, V], collective
        sampling_rows = np.flatnonzero(done).tolist()
        if not sampling_rows:
            return emitted, None
        if masks is not None:
            self.grammars.apply(logits, masks)
        sampling = self.metadata([rows[i] for i in sampling_rows])
        logprobs = None
        plain = [i for i in sampling_rows if num_drafts[i] == 0]
        verify = [i for i in sampling_rows if num_drafts[i] > 0]
        dev = logits.device
        if plain:
            part = sampling.select([j for j, i in enumerate(sampling_rows) if num_drafts[i] == 0])
            out = self.sampler(logits[torch.tensor(row_start[plain], device=dev)], part)
            for i, token in zip(plain, out.sampled_token_ids.tolist()):
                emitted[i] = [token]
            if out.logprobs is not None:       # FULL rows verify no drafts: one token, as without speculation
                logprobs = [None] * len(rows)
                params = [self.batch.params[rows[i]] for i in plain]
                for i, entry in zip(plain, _logprob_entries(out.logprobs, params)):
                    logprobs[i] = entry
        if verify:
            part = sampling.select([j for j, i in enumerate(sampling_rows) if num_drafts[i] > 0])
            k = num_drafts[verify].max()
            padded = torch.tensor([drafts[i] + [0] * (k - len(drafts[i])) for i in verify], dtype=torch.int64,
                                  device=dev)
            tokens, counts = self.rejection(logits, torch.tensor(row_start[verify], device=dev),
                                            torch.tensor(num_drafts[verify], device=dev), padded, part)
            for i, t, c in zip(verify, tokens.tolist(), counts.tolist()):
                emitted[i] = t[:c]
        return emitted, logprobs

    def verify_on_device(self, so: SchedulerOutput, batch: ScheduledBatch, local: torch.Tensor,
                         greedy: torch.Tensor, ids: torch.Tensor, k: int,
                         masks=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Graph verification, without a host sync: every request verifies exactly k drafts (0:
        a switch step, each request samples its next token as an eager step samples a request
        without drafts, seeded draws alike); local / greedy: [b * (k + 1), ...] of the padded
        batch, ids: [b, k + 1] its input tokens; masks: the step's `grammar_masks` (rows
        i * (k + 1) + j), filled before the replay. -> (emitted [b, k + 1] int64, kept drafts [b]
        int64); padding rows emit what they like."""
        n, q = batch.num_reqs, k + 1
        b = ids.shape[0]
        dev = local.device
        argmax = bool((self.modes(so, batch) == SamplingMode.ARGMAX).all())
        if argmax and self.rejection.method == "standard":
            emitted = greedy.view(b, q)
            kept = torch.cumprod((ids[:, 1:] == emitted[:, :k]).long(), dim=1).sum(dim=1)    # [b]
            return emitted, kept
        sampling = self.metadata(batch.rows.tolist())
        logits = self.head.gather(local[:n * q])                                      # collective
        if masks is not None:
            self.grammars.apply(logits, masks)
        emitted = torch.zeros(b, q, dtype=torch.int64, device=dev)
        kept = torch.zeros(b, dtype=torch.int64, device=dev)
        if k == 0:
            emitted[:n, 0] = self.sampler(logits, sampling).sampled_token_ids
            return emitted, kept
        num_drafts = torch.full((n,), k, device=dev)
        tokens, counts = self.rejection(logits, torch.arange(n, device=dev) * q, num_drafts, ids[:n, 1:],
                                        sampling)
        emitted[:n], kept[:n] = tokens.clamp_min(0), counts - 1
        return emitted, kept

    def speculative_output(self, so: SchedulerOutput, batch: ScheduledBatch, emitted: list[list[int]],
                           proposals: list[list[int]], done, logprobs: list | None = None,
                           prompt_logprobs: dict | None = None) -> ModelRunnerOutput | None:
        """The verify step's output on the driver: emitted tokens, and the next drafts of the
        requests that sampled (the scheduler drops those its next step's mode cannot verify),
        with the `logprobs` / `prompt_logprobs` of requests that asked (eager steps only).
        On every rank that samples, first advance each constrained request's grammar over the
        tokens it emitted (kept drafts and the token after them), and no further."""
        self.failed = {}
        if self.grammars is not None:
            self._advance_grammars(so, batch, emitted, done)
        if not self.is_driver:
            return None
        spec = [proposals[i] if done[i] else [] for i in range(batch.num_reqs)]
        return ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=[e or [0] for e in emitted],
                                 spec_token_ids=spec, failed=self.failed,
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs or {})

    def _advance_grammars(self, so: SchedulerOutput, batch: ScheduledBatch, emitted: list[list[int]],
                          done) -> None:
        modes = self.modes(so, batch)
        b = self.batch
        for i, row in enumerate(batch.rows.tolist()):
            if not done[i] or modes[i] not in (SamplingMode.GRAMMAR, SamplingMode.FULL):
                continue
            req_id, params = b.req_ids[row], b.params[row]
            for token in emitted[i]:
                if not self.grammars.accept(req_id, params, token):
                    self.failed[req_id] = GRAMMAR_DEAD_END
                    break


def _logprob_entries(lp, params) -> list[list[LogprobEntry] | None]:
    """Per request: its sampled token's logprob entry, None where it asked for none."""
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
