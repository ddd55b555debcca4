"""One step's model inputs on the device: token ids and the attention metadata (query start
offsets, sequence lengths, block tables; positions and slot mapping computed on the device).

`StepBuffers` owns a pinned host staging buffer and its device twin, laid out as
  [seq_lens (R) | query_start_loc (R + 1) | token_ids (T) | block_table (R x W)]   int32
with fixed offsets, so the device views have stable addresses: eager steps and CUDA-graph
replays read the same tensors, and a step's inputs travel in ONE host-to-device copy of the
prefix that holds them. A window draft (DSpark) adds [draft_valid_from (R) | draft_block_table
(R x W)] after them, in a second copy (through the draft tables of the rows staged). Rows past
the step's requests are padding rows: a one-token request on the null page (block 0), which the
graphs use to fill a captured batch size.
"""
from __future__ import annotations

import numpy as np
import torch

from m3serve.layers.attention_metadata import AttentionMetadata, positions_and_slots
from m3serve.worker.input_batch import InputBatch, ScheduledBatch


class StepBuffers:
    def __init__(self, max_reqs: int, max_tokens: int, max_blocks: int, block_size: int,
                 device: torch.device, draft_tables: bool = False):
        self.max_reqs, self.max_tokens, self.max_blocks = max_reqs, max_tokens, max_blocks
        self.block_size, self.device = block_size, device
        R, T, W = max_reqs, max_tokens, max_blocks
        self._seq, self._qsl, self._tok = 0, R, 2 * R + 1
        self._feed = 2 * R + 1 + T               # async scheduling: [R] token slots, [R] sources
        self._bt = self._feed + 2 * R
        self._dvf = self._bt + R * W             # window draft: [R] valid-from, [R x W] tables
        self._dbt = self._dvf + R
        self.has_draft_tables = draft_tables
        size = self._dbt + R * W if draft_tables else self._dvf
        cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=cuda)
        self.np = self.host.numpy()
        self.dev = self.host.to(device) if cuda else torch.zeros(size, dtype=torch.int32)
        self.seq_lens = self.dev[self._seq:self._qsl]
        self.query_start_loc = self.dev[self._qsl:self._tok]
        self.token_ids = self.dev[self._tok:self._feed]
        self.feed_slots = self.dev[self._feed:self._feed + R]
        self.feed_sources = self.dev[self._feed + R:self._bt]
        self.block_tables = self.dev[self._bt:self._dvf].view(R, W)
        self.draft_valid_from = self.dev[self._dvf:self._dbt] if draft_tables else None
        self.draft_block_tables = self.dev[self._dbt:].view(R, W) if draft_tables else None
        # the host copy of the previous step may still be in flight when the next one is staged
        self._copied = torch.cuda.Event() if cuda else None

    def stage(self, batch: ScheduledBatch | None, input_batch: InputBatch, pad_to: int = 0,
              pad_query_len: int = 1, feed: tuple[np.ndarray, np.ndarray] | None = None) -> int:
        """Write a step's inputs (None: no requests) plus padding rows up to `pad_to` requests
        (`pad_query_len` tokens each), and start the copy to the device. `feed` (async
        scheduling): token slots of this step and the positions, in the previous step's sampled
        ids, of the tokens that fill them; they travel with the same copy and `feed_tokens`
        applies them. Returns the number of rows staged."""
        n = batch.num_reqs if batch is not None else 0
        rows_total = max(n, pad_to)
        t = batch.num_tokens if batch is not None else 0
        q = pad_query_len
        tokens_total = t + (rows_total - n) * q
        if rows_total > self.max_reqs or tokens_total > self.max_tokens:
            raise RuntimeError(f"step of {rows_total} requests / {tokens_total} tokens exceeds the "
                               f"input buffers ({self.max_reqs} / {self.max_tokens})")
        if self._copied is not None:
            self._copied.synchronize()
        h = self.np
        seq = h[self._seq:self._seq + rows_total]
        qsl = h[self._qsl:self._qsl + rows_total + 1]
        tok = h[self._tok:self._tok + tokens_total]
        table = h[self._bt:self._bt + rows_total * self.max_blocks].reshape(rows_total, self.max_blocks)
        if n:
            seq[:n] = batch.seq_lens
            qsl[:n + 1] = batch.query_start_loc
            tok[:t] = batch.token_ids
            np.take(input_batch.block_table, batch.rows, axis=0, out=table[:n])
        else:
            qsl[0] = 0
        if feed is not None:
            k = len(feed[0])
            h[self._feed:self._feed + k] = feed[0]
            h[self._feed + self.max_reqs:self._feed + self.max_reqs + k] = feed[1]
        if rows_total > n:                  # padding: q tokens each, on the null page
            seq[n:] = q
            qsl[n + 1:] = t + q * np.arange(1, rows_total - n + 1, dtype=np.int32)
            tok[t:] = 0
            table[n:, 0] = 0
        if self.has_draft_tables:
            valid, dtable = self._draft_views(rows_total)
            if n:
                np.take(input_batch.draft_valid_from, batch.rows, out=valid[:n])
                np.take(input_batch.draft_block_table, batch.rows, axis=0, out=dtable[:n])
            valid[n:] = 0
            dtable[n:] = 0
        self._upload(rows_total)
        return rows_total

    def stage_null(self, query_lens: list[int],
                   seq_lens: list[int] | None = None) -> tuple[list[int], list[int]]:
        """Rows on the null page: row r computes the last query_lens[r] tokens (token 0) of a
        context of seq_lens[r] (default: query_lens[r], a prompt from position 0), and every
        block-table entry is 0, so all reads and writes land in block 0: the start-up kernel
        warm-up's forwards. Returns (query_start_loc, seq_lens) as host lists."""
        seq_lens = list(query_lens) if seq_lens is None else list(seq_lens)
        R, T = len(query_lens), sum(query_lens)
        if not 0 < R <= self.max_reqs or T > self.max_tokens or len(seq_lens) != R \
                or min(query_lens) < 1 or any(s < q for q, s in zip(query_lens, seq_lens)) \
                or max(seq_lens) > self.max_blocks * self.block_size:
            raise ValueError(f"null rows {query_lens} (contexts {seq_lens}) do not fit the input "
                             f"buffers ({self.max_reqs} requests, {self.max_tokens} tokens, "
                             f"{self.max_blocks * self.block_size}-token contexts)")
        if self._copied is not None:
            self._copied.synchronize()
        h = self.np
        qsl = [0, *np.cumsum(query_lens).tolist()]
        h[self._seq:self._seq + R] = seq_lens
        h[self._qsl:self._qsl + R + 1] = qsl
        h[self._tok:self._tok + T] = 0
        h[self._bt:self._bt + R * self.max_blocks] = 0
        if self.has_draft_tables:
            valid, dtable = self._draft_views(R)
            valid[:] = 0
            dtable[:] = 0
        self._upload(R)
        return qsl, seq_lens

    def _draft_views(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Host views of the window draft's valid-from [rows] and block tables [rows, W]."""
        h, W = self.np, self.max_blocks
        return h[self._dvf:self._dvf + rows], h[self._dbt:self._dbt + rows * W].reshape(rows, W)

    def _upload(self, rows: int) -> None:
        """Start the copy of the staged host buffer (through the block tables of `rows` rows) to
        the device; the next staging waits for it."""
        end = self._bt + rows * self.max_blocks
        self.dev[:end].copy_(self.host[:end], non_blocking=True)
        if self.has_draft_tables:
            # every row's valid-from, then the draft tables of `rows` rows
            start, stop = self._dvf, self._dbt + rows * self.max_blocks
            self.dev[start:stop].copy_(self.host[start:stop], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def feed_tokens(self, num: int, sampled: torch.Tensor) -> None:
        """Write the previous step's sampled ids [R'] (still on the device) into the first `num`
        staged feed slots."""
        if num:
            slots, sources = self.feed_slots[:num].long(), self.feed_sources[:num].long()
            self.token_ids.index_copy_(0, slots, sampled.index_select(0, sources).to(self.token_ids.dtype))

    def inputs(self, num_reqs: int, num_tokens: int, one_token_each: bool,
               query_start_loc_cpu: list[int], seq_lens_cpu: list[int], max_query_len: int = 0,
               max_seq_len: int = 0, dp_padded_tokens: int = 0):
        """(token ids [T], positions [T], AttentionMetadata) over the staged device views; only
        device work, so a CUDA graph can capture it."""
        qsl = self.query_start_loc[:num_reqs + 1]
        seq = self.seq_lens[:num_reqs]
        tables = self.block_tables[:num_reqs]
        positions, slots = positions_and_slots(qsl, seq, tables, num_tokens, self.block_size,
                                               one_token_each)
        meta = AttentionMetadata(
            query_start_loc=qsl, seq_lens=seq, block_tables=tables, slot_mapping=slots,
            query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu,
            block_size=self.block_size, max_query_len=max_query_len, max_seq_len=max_seq_len,
            dp_padded_tokens=dp_padded_tokens)
        return self.token_ids[:num_tokens], positions, meta
