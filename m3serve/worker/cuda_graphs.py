"""CUDA graphs of pure-decode steps: the forward, this rank's logits and the argmax of a batch
padded to one of the capture sizes, captured over the runner's `StepBuffers` (stable addresses)
and replayed after the step's inputs are staged there.

Padding rows are one-token requests on the null page (block 0), so no kernel needs to know
about padding. Kernel launch shapes are fixed at capture by the host-side bounds
(max_query_len = 1, max_seq_len = max_model_len). Positions and slots are computed inside the
graph from the staged sequence lengths and block table. Collectives of the forward (TP
all-reduces, the vocabulary-parallel argmax, the DP exchange of the MoE layers) are captured too.
"""
from __future__ import annotations

import logging
import time

import torch

from m3serve.layers import probes
from m3serve.worker.attn_metadata import StepBuffers

logger = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return [b for b in sizes if b <= max_num_seqs] or [1]


def capture_sizes(config, device_type: str) -> list[int]:
    """The batch sizes an engine of `config` captures decode (and verify) graphs for on
    `device_type` ranks; none on a CPU or with enforce_eager."""
    if device_type != "cuda" or config.compilation.enforce_eager:
        return []
    return list(config.compilation.cudagraph_capture_sizes or default_capture_sizes(config.scheduler.max_num_seqs))


class DecodeGraphs:
    def __init__(self, model, buffers: StepBuffers, sizes: list[int], max_model_len: int,
                 dp_exchange: bool = False):
        self.model, self.buffers, self.sizes = model, buffers, sorted(sizes)
        self.max_model_len = max_model_len
        self.dp_exchange = dp_exchange     # MoE layers exchange tokens with other DP replicas
        # per size: (graph, final hidden [b, H], this rank's fp32 logits [b, V_local], argmax [b])
        self.graphs: dict[int, tuple] = {}
        # per graph: what its layers reported to layers/probes.py at capture, replayed to the
        # installed probe after each replay (the bench's measured expert count reads them)
        self.reports = probes.GraphReports()
        self.capture_seconds = 0.0
        # per size: the graph's nodes read back at capture (worker/graph_nodes.py), or None
        self.node_counts: dict[int, dict | None] = {}

    def forward(self, b: int, seq_lens_cpu: list[int] | None = None):
        """The captured work for batch size b: (hidden [b, H], local logits [b, V_local],
        greedy ids [b]). Kernels read the lengths on the device; `seq_lens_cpu` serves the
        reference ops, which read them on the host (tests replaying the graph eagerly on CPU)."""
        ids, positions, meta = self.buffers.inputs(
            b, b, True, list(range(b + 1)), seq_lens_cpu or [1] * b, max_query_len=1,
            max_seq_len=self.max_model_len, dp_padded_tokens=b if self.dp_exchange else 0)
        hidden = self.model(ids, positions, meta)
        local, greedy = self.model.lm_head.logits_and_greedy(hidden)
        return hidden, local, greedy

    @torch.inference_mode()
    def capture(self, input_batch) -> None:
        start = time.perf_counter()
        self.buffers.stage(None, input_batch, pad_to=self.sizes[-1])   # all rows padding
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):                 # largest first: later ones reuse its pool
            with probes.installed(None):
                for _ in range(2):                     # warm-up: compile kernels, settle allocator
                    self.forward(b)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph(keep_graph=True)     # read back below, then instantiated
            with self.reports.collect(b), torch.cuda.graph(graph, pool=pool):
                outputs = self.forward(b)
            self.node_counts[b] = self._count_nodes(graph)
            graph.instantiate()
            self.graphs[b] = (graph, *outputs)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.sizes),
                    ",".join(map(str, self.sizes)), self.capture_seconds)

    def _count_nodes(self, graph) -> dict | None:
        """The captured graph's kernels by class, per MoE layer as well (`kernels_per_layer`);
        None where the driver cannot be asked (logged once at debug level)."""
        from m3serve.worker.graph_nodes import summarize
        layers = getattr(self.model, "cfg", None)
        moe_layers = sum(layers.is_moe(i) for i in range(layers.num_hidden_layers)) if layers else 0
        try:
            return summarize(graph.raw_cuda_graph(), moe_layers)
        except (OSError, RuntimeError, AttributeError) as e:
            logger.debug("could not read the captured graph's nodes: %s", e)
            return None

    def padded_size(self, num_reqs: int) -> int | None:
        for b in self.sizes:
            if b >= num_reqs:
                return b
        return None

    def replay(self, b: int, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replay the size-b graph over the staged inputs -> (hidden [n, H], local logits
        [n, V_local], argmax [n]) of the first n = num_reqs rows: views of static buffers,
        valid until the next replay. An installed probe receives the layers' reports of this
        replay (layers/probes.py)."""
        graph, hidden, logits, greedy = self.graphs[b]
        graph.replay()
        # with a DP exchange the MoE's rows are every replica's, padded: kept whole, as eager
        self.reports.replay_to(b, b if self.dp_exchange else num_reqs, b)
        return hidden[:num_reqs], logits[:num_reqs], greedy[:num_reqs]
