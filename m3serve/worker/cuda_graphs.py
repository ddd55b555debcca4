"""CUDA graphs for pure-decode steps: the model forward and the logits of a batch padded to one
of the capture sizes, replayed with inputs copied into static buffers (stable addresses).

Padding rows are dummy one-token requests on the null page (slot -1: nothing is written), so no
kernel needs to know about padding. Kernel launch shapes are fixed at capture by the host-side
bounds (max_query_len = 1, max_seq_len = max_model_len).

Inputs travel in two host-to-device copies per step from pinned staging buffers (int64: token
ids, positions, slots; int32: sequence lengths then the block table), whose device twins the
graphs read in place. The graph also takes the argmax of the logits, so a greedy step reads back
only [n] token ids. The staging buffers are rewritten by the next step, which is safe because
every step waits for its sampled tokens before the next one is prepared.
"""
from __future__ import annotations

import logging
import time

import torch

from m3serve.layers.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return [b for b in sizes if b <= max_num_seqs] or [1]


class DecodeGraphs:
    def __init__(self, model, sizes: list[int], block_size: int, max_model_len: int, device):
        self.model, self.sizes = model, sorted(sizes)
        self.block_size, self.max_model_len = block_size, max_model_len
        bmax = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        pinned = torch.device(device).type == "cuda"
        self._host64 = torch.zeros(3, bmax, dtype=torch.int64, pin_memory=pinned)   # ids, pos, slot
        self._host32 = torch.zeros(bmax * (1 + max_blocks), dtype=torch.int32, pin_memory=pinned)
        self._np64, self._np32 = self._host64.numpy(), self._host32.numpy()
        self._np_seq = self._np32[:bmax]
        self._np_table = self._np32[bmax:].reshape(bmax, max_blocks)
        self._np64[2].fill(-1)
        self._np_seq.fill(1)
        self._dev64 = self._host64.to(device)
        self._dev32 = self._host32.to(device)
        self.input_ids, self.positions, self.slot_mapping = self._dev64[0], self._dev64[1], self._dev64[2]
        self.seq_lens = self._dev32[:bmax]
        self.block_tables = self._dev32[bmax:].view(bmax, max_blocks)
        self.query_start_loc = torch.arange(bmax + 1, dtype=torch.int32, device=device)
        # per size: (graph, fp32 logits [b, V], argmax token ids [b])
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        # per graph: the MoE layers' expert-id buffers it writes (for the measured expert count)
        self.expert_ids: dict[int, list[torch.Tensor]] = {}
        self.moe_layers = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.capture_seconds = 0.0

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b],
            query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=[1] * b, block_size=self.block_size,
            max_query_len=1, max_seq_len=self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):                 # largest first: later ones reuse its pool
            meta = self._meta(b)
            for _ in range(2):                         # warm-up: compile kernels, settle allocator
                self.model.compute_logits(self.model(self.input_ids[:b], self.positions[:b], meta))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.compute_logits(self.model(self.input_ids[:b], self.positions[:b], meta))
                greedy = logits.argmax(dim=-1)
            self.graphs[b] = (graph, logits, greedy)
            self.expert_ids[b] = [m.last_expert_ids for m in self.moe_layers]
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.sizes),
                    ",".join(map(str, self.sizes)), self.capture_seconds)

    def padded_size(self, num_reqs: int) -> int | None:
        for b in self.sizes:
            if b >= num_reqs:
                return b
        return None

    def run(self, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for n requests -> (fp32 logits [n, V], argmax ids [n]): views of
        static buffers, valid until the next replay."""
        n = len(ids)
        b = self.padded_size(n)
        graph, logits, greedy = self.graphs[b]
        h64, seq, table = self._np64, self._np_seq, self._np_table
        h64[0, :n], h64[1, :n], h64[2, :n], seq[:n] = ids, positions, slots, seq_lens
        for i, blocks in enumerate(block_ids):
            table[i, :len(blocks)] = blocks
        if n < b:                                       # padding rows: null page, no writes
            h64[2, n:b], seq[n:b], table[n:b] = -1, 1, 0
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32.copy_(self._host32, non_blocking=True)
        graph.replay()
        for m, ids_buf in zip(self.moe_layers, self.expert_ids[b]):
            m.last_expert_ids = ids_buf[:n]
        return logits[:n], greedy[:n]
