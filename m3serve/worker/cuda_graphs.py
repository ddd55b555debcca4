"""CUDA graphs for pure-decode steps: the model forward and the logits of a batch padded to one
of the capture sizes, replayed with inputs copied into static buffers (stable addresses).

Padding rows are dummy one-token requests on the null page (slot -1: nothing is written), so no
kernel needs to know about padding. Kernel launch shapes are fixed at capture by the host-side
bounds (max_query_len = 1, max_seq_len = max_model_len).
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
        self.input_ids = torch.zeros(bmax, dtype=torch.int64, device=device)
        self.positions = torch.zeros(bmax, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((bmax,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(bmax, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(bmax + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(bmax, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
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
            self.graphs[b] = (graph, logits)
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

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """One decode step for n requests (CPU tensors) -> fp32 logits [n, V] (a view of a
        static buffer, valid until the next replay)."""
        n = ids.shape[0]
        b = self.padded_size(n)
        graph, logits = self.graphs[b]
        self.input_ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slots, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        width = block_table.shape[1]
        self.block_tables[:n, :width].copy_(block_table, non_blocking=True)
        if n < b:                                       # padding rows: null page, no writes
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b].zero_()
        graph.replay()
        for m, ids in zip(self.moe_layers, self.expert_ids[b]):
            m.last_expert_ids = ids[:n]
        return logits[:n]
