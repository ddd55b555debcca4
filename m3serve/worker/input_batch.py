"""The persistent input batch: one row per request the worker knows, kept across steps and
updated from each `SchedulerOutput` diff.

A row holds the request's token ids (prompt + accepted outputs, then this step's drafts past
the end), how many of them have KV in the cache, its block-table row, and its sampling state
(params, generator); with a window draft (DSpark), also the draft's own block-table row (the
logical blocks it holds, 0 elsewhere) and the first position whose draft KV is valid. Rows are
dense (0 .. num_rows - 1): removing a request moves the last row into its place. A step's batch
is the scheduled requests in the scheduler's order, as row indices (`ScheduledBatch`);
everything per token is computed with numpy over those rows, never in a Python loop over tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from m3serve.core.scheduler_output import DraftBlocks, SchedulerOutput
from m3serve.sampling_params import SamplingParams
from m3serve.worker.sampler import make_generator


@dataclass
class ScheduledBatch:
    """One step's requests, in scheduler order, as views over the batch's rows."""
    req_ids: list[str]
    rows: np.ndarray             # [R] int64 row of each scheduled request
    num_scheduled: np.ndarray    # [R] int32 query tokens per request (drafts included)
    seq_lens: np.ndarray         # [R] int32 context length after this step
    query_start_loc: np.ndarray  # [R + 1] int32
    positions: np.ndarray        # [T] int64 position of every query token
    token_ids: np.ndarray        # [T] int32
    is_decode: bool              # every request computes exactly one token

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


class InputBatch:
    """Rows of every request this worker knows (running, or preempted and waiting to resume)."""

    def __init__(self, max_model_len: int, block_size: int, device: torch.device,
                 capacity: int = 64, make_generators: bool = True, extra_positions: int = 0,
                 draft_tables: bool = False):
        self.max_model_len, self.block_size, self.device = max_model_len, block_size, device
        # a draft writes KV up to extra_positions past the context (its lookahead)
        self.max_blocks = -(-(max_model_len + extra_positions) // block_size)
        self.extra_positions = extra_positions
        self.make_generators = make_generators   # only the rank that samples needs them
        self.draft_tables = draft_tables         # a window draft's own block tables
        self.req_ids: list[str] = []
        self.index: dict[str, int] = {}
        self.params: list[SamplingParams] = []
        self.generators: list[torch.Generator | None] = []
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        old = getattr(self, "num_tokens", None)
        self.capacity = capacity
        # Zero-filled pages are only touched when written, so a wide row costs what it holds.
        # Extra columns: a verify step may hold its drafts past the longest context.
        width = self.max_model_len + 1 + self.extra_positions
        fresh = {
            "token_ids": np.zeros((capacity, width), dtype=np.int32),
            "num_tokens": np.zeros(capacity, dtype=np.int32),         # prompt + accepted outputs
            "num_prompt_tokens": np.zeros(capacity, dtype=np.int32),
            "num_computed": np.zeros(capacity, dtype=np.int32),      # tokens with KV in the cache
            "block_table": np.zeros((capacity, self.max_blocks), dtype=np.int32),
            "num_blocks": np.zeros(capacity, dtype=np.int32),
        }
        if self.draft_tables:        # held draft blocks: logical [draft_first, draft_end)
            fresh.update({"draft_block_table": np.zeros((capacity, self.max_blocks), dtype=np.int32),
                          "draft_first": np.zeros(capacity, dtype=np.int32),
                          "draft_end": np.zeros(capacity, dtype=np.int32),
                          "draft_valid_from": np.zeros(capacity, dtype=np.int32)})
        if old is not None:
            n = self.num_rows
            for name, arr in fresh.items():
                if name == "token_ids":          # copy only what each row holds
                    for row in range(n):
                        arr[row, :old[row]] = self.token_ids[row, :old[row]]
                else:
                    arr[:n] = getattr(self, name)[:n]
        for name, arr in fresh.items():
            setattr(self, name, arr)

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    # ---------------------------------------------------------------- rows

    def add(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
            block_ids: list[int], num_computed_tokens: int, draft_blocks: DraftBlocks | None = None) -> None:
        if req_id in self.index:
            raise RuntimeError(f"request {req_id!r} is already in the input batch")
        if self.num_rows == self.capacity:
            self._alloc(2 * self.capacity)
        row = self.num_rows
        n = len(prompt_token_ids)
        if n > self.max_model_len:
            raise RuntimeError(f"request {req_id!r}: {n} prompt tokens exceed max_model_len")
        if len(block_ids) > self.max_blocks:     # checked before the row exists: no half-added row
            raise RuntimeError(f"request {req_id!r}: {len(block_ids)} blocks exceed the "
                               f"{self.max_blocks} a max_model_len context needs")
        self.req_ids.append(req_id)
        self.index[req_id] = row
        self.token_ids[row, :n] = prompt_token_ids
        self.num_tokens[row] = self.num_prompt_tokens[row] = n
        self.num_computed[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self._set_blocks(row, block_ids, replace=True)
        if self.draft_tables:
            self._clear_draft(row)
            self._set_draft(row, draft_blocks)
        self.params.append(params)
        gen = None
        if self.make_generators and params.seed is not None and not params.is_greedy:
            gen = make_generator(params.seed, self.device)
        self.generators.append(gen)

    def remove(self, req_id: str) -> None:
        row = self.index.pop(req_id, None)
        if row is None:
            return
        last = self.num_rows - 1
        if row != last:                      # move the last row into the hole
            moved = self.req_ids[last]
            n = self.num_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            for name in ("num_tokens", "num_prompt_tokens", "num_computed", "num_blocks"):
                arr = getattr(self, name)
                arr[row] = arr[last]
            self.block_table[row, :self.num_blocks[last]] = self.block_table[last, :self.num_blocks[last]]
            if self.draft_tables:
                self._clear_draft(row)
                lo, hi = self.draft_first[last], self.draft_end[last]
                self.draft_block_table[row, lo:hi] = self.draft_block_table[last, lo:hi]
                for name in ("draft_first", "draft_end", "draft_valid_from"):
                    getattr(self, name)[row] = getattr(self, name)[last]
            self.req_ids[row], self.params[row], self.generators[row] = (
                moved, self.params[last], self.generators[last])
            self.index[moved] = row
        if self.draft_tables:
            self._clear_draft(last)
        self.req_ids.pop()
        self.params.pop()
        self.generators.pop()

    def _clear_draft(self, row: int) -> None:
        """The row holds no draft block (every entry 0, the null block)."""
        self.draft_block_table[row, self.draft_first[row]:self.draft_end[row]] = 0
        self.draft_first[row] = self.draft_end[row] = self.draft_valid_from[row] = 0

    def _set_draft(self, row: int, update: DraftBlocks | None) -> None:
        """Apply a `DraftBlocks` diff: entries below its first block are released (0), its new
        blocks follow the last one held."""
        if update is None:
            return
        first, end = int(self.draft_first[row]), int(self.draft_end[row])
        if update.first_block > first:
            self.draft_block_table[row, first:min(update.first_block, end)] = 0
            first = update.first_block
            end = max(end, first)
        n = len(update.new_block_ids)
        if end + n > self.max_blocks:
            raise RuntimeError(f"request {self.req_ids[row]!r}: draft blocks up to {end + n} exceed the "
                               f"{self.max_blocks} a max_model_len context needs")
        self.draft_block_table[row, end:end + n] = update.new_block_ids
        self.draft_first[row], self.draft_end[row] = first, end + n
        self.draft_valid_from[row] = update.valid_from

    def _set_blocks(self, row: int, block_ids: list[int] | None, replace: bool) -> None:
        start = 0 if replace else int(self.num_blocks[row])
        if block_ids:
            end = start + len(block_ids)
            if end > self.max_blocks:
                raise RuntimeError(f"request {self.req_ids[row]!r}: {end} blocks exceed the "
                                   f"{self.max_blocks} a max_model_len context needs")
            self.block_table[row, start:end] = block_ids
            self.num_blocks[row] = end
        elif replace:
            self.num_blocks[row] = 0

    def apply(self, so: SchedulerOutput, in_flight=()) -> list[tuple[str, int]]:
        """Bring the rows up to date with one step's diff (see `SchedulerOutput`). `in_flight`:
        requests whose newest token is still on the device (async scheduling): each scheduled
        one gets a placeholder slot after its tokens, filled when the token lands. Returns the
        placeholders made: (request id, position)."""
        for req_id in so.finished_req_ids:
            self.remove(req_id)
        for req_id in so.preempted_req_ids:
            row = self.index.get(req_id)
            if row is not None:
                self.num_blocks[row] = 0       # keeps its tokens for the resume
                if self.draft_tables:
                    self._clear_draft(row)
        for new in so.scheduled_new_reqs:
            self.add(new.req_id, new.prompt_token_ids, new.sampling_params, new.block_ids,
                     new.num_computed_tokens, new.draft_blocks)
        c = so.scheduled_cached_reqs
        placeholders = []
        for i, req_id in enumerate(c.req_ids):
            row = self.index[req_id]
            new_tokens = list(c.new_token_ids[i])
            if req_id in in_flight:
                new_tokens.append(0)             # its value arrives from the device
                placeholders.append((req_id, int(self.num_tokens[row]) + len(new_tokens) - 1))
            if new_tokens:
                n = int(self.num_tokens[row])
                if n + len(new_tokens) > self.max_model_len:
                    raise RuntimeError(f"request {req_id!r} grows past max_model_len")
                self.token_ids[row, n:n + len(new_tokens)] = new_tokens
                self.num_tokens[row] = n + len(new_tokens)
            self._set_blocks(row, c.new_block_ids[i], replace=c.resumed_from_preemption[i])
            if self.draft_tables and c.draft_blocks:
                if c.resumed_from_preemption[i]:
                    self._clear_draft(row)
                self._set_draft(row, c.draft_blocks[i])
            self.num_computed[row] = c.num_computed_tokens[i]
        return placeholders

    # ---------------------------------------------------------------- one step

    def schedule(self, so: SchedulerOutput) -> ScheduledBatch:
        """The step's batch (after `apply`): rows, query lengths, positions and token ids of
        the scheduled requests, in the scheduler's order. Drafts are written past each row's
        accepted tokens, where the step reads them."""
        req_ids = list(so.num_scheduled_tokens)
        index = self.index
        rows = np.fromiter((index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int32, count=len(req_ids))
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            row = index[req_id]
            n = int(self.num_tokens[row])
            self.token_ids[row, n:n + len(drafts)] = drafts
        start = self.num_computed[rows]                                    # [R]
        seq_lens = (start + num_sched).astype(np.int32)
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int32)
        np.cumsum(num_sched, out=qsl[1:])
        total = int(qsl[-1])
        if total == len(req_ids):                                          # one token each
            positions = start.astype(np.int64)
            req_of_token = rows
        else:
            req = np.repeat(np.arange(len(req_ids)), num_sched)            # [T]
            offsets = np.arange(total) - qsl[:-1][req]
            positions = start[req].astype(np.int64) + offsets
            req_of_token = rows[req]
        token_ids = self.token_ids[req_of_token, positions]                # [T]
        return ScheduledBatch(req_ids, rows, num_sched, seq_lens, qsl, positions, token_ids,
                              is_decode=total == len(req_ids))

    def advance(self, batch: ScheduledBatch) -> None:
        """After the step: its tokens' KV is in the cache."""
        self.num_computed[batch.rows] = batch.seq_lens

    # ---------------------------------------------------------------- sampling views

    def output_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.num_prompt_tokens[row]:self.num_tokens[row]]

    def prompt_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, :self.num_prompt_tokens[row]]

    def block_ids(self, row: int) -> np.ndarray:
        return self.block_table[row, :self.num_blocks[row]]
