"""CUDA graphs of the speculative decode step: every request verifies exactly k drafts (k + 1
query tokens), padded to a capture size b.

- verify(b): the target forward over the staged b x (k + 1) tokens -> final hidden states,
  the tapped streams (EAGLE3), this rank's logits and their argmax, for every token;
- draft(b): from each request's last verified position (`last_index`) and the token after it
  (`last_token`), both written on the device between the two replays, the proposer's first pass
  over the step's tokens and its k - 1 one-token steps -> drafts [b, k].
Acceptance is decided on the device between the replays (greedy: the leading run of drafts
equal to the argmax; sampled: the rejection sampler), so a step costs one host sync, for the
emitted tokens and the next drafts together.
"""
from __future__ import annotations

import logging
import time

import torch

from m3serve.layers import probes

logger = logging.getLogger(__name__)


class SpecDecodeGraphs:
    def __init__(self, model, proposer, buffers, sizes: list[int], k: int, max_model_len: int):
        self.model, self.proposer, self.buffers = model, proposer, buffers
        self.sizes, self.k, self.q = sorted(sizes), k, k + 1
        self.max_seq_len = max_model_len + k
        dev = buffers.dev.device
        bmax = self.sizes[-1]
        self.last_index = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.last_token = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.verify_graphs: dict[int, tuple] = {}   # b -> (graph, hidden, taps, local, greedy, positions)
        self.draft_graphs: dict[int, tuple] = {}    # b -> (graph, drafts)
        self.reports = probes.GraphReports()        # layers/probes.py reports, replayed to a probe
        self.capture_seconds = 0.0

    def _inputs(self, b: int, seq_lens_cpu: list[int] | None):
        T = b * self.q
        return self.buffers.inputs(b, T, False, list(range(0, T + 1, self.q)), seq_lens_cpu or [self.q] * b,
                                   max_query_len=self.q, max_seq_len=self.max_seq_len)

    def verify_forward(self, b: int, seq_lens_cpu: list[int] | None = None):
        ids, positions, meta = self._inputs(b, seq_lens_cpu)
        taps = self.proposer.taps
        out = self.model(ids, positions, meta, taps)
        hidden, tapped = out if taps else (out, out)
        local, greedy = self.model.lm_head.logits_and_greedy(hidden)
        return hidden, tapped, local, greedy, positions

    def draft_forward(self, b: int, hidden_in: torch.Tensor, seq_lens_cpu: list[int] | None = None,
                      last_positions_cpu: list[int] | None = None) -> torch.Tensor:
        ids, positions, meta = self._inputs(b, seq_lens_cpu)
        last = self.last_index[:b]
        next_ids = torch.roll(ids.long(), -1)
        next_ids[last] = self.last_token[:b]
        buffers = self.buffers
        own = buffers.draft_block_tables[:b] if buffers.draft_block_tables is not None else None
        token, prev = self.proposer.first_pass(next_ids, positions, meta, hidden_in, last, own)
        return self.proposer.draft_steps(token, prev, positions[last],
                                         own if own is not None else buffers.block_tables[:b],
                                         last_positions_cpu,
                                         buffers.draft_valid_from[:b] if own is not None else None)

    @torch.inference_mode()
    def capture(self, input_batch) -> None:
        start = time.perf_counter()
        self.buffers.stage(None, input_batch, pad_to=self.sizes[-1], pad_query_len=self.q)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self.last_index[:b] = torch.arange(b, device=self.last_index.device) * self.q
            with probes.installed(None):
                for _ in range(2):                 # warm-up: compile kernels, settle the allocator
                    _, tapped, *_ = self.verify_forward(b)
                    self.draft_forward(b, tapped)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with self.reports.collect(("verify", b)), torch.cuda.graph(graph, pool=pool):
                outputs = self.verify_forward(b)
            self.verify_graphs[b] = (graph, *outputs)
            graph = torch.cuda.CUDAGraph()
            with self.reports.collect(("draft", b)), torch.cuda.graph(graph, pool=pool):
                drafts = self.draft_forward(b, outputs[1])
            self.draft_graphs[b] = (graph, drafts)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d speculative verify + draft CUDA graph pairs (batch %s, k %d) in %.1f s",
                    len(self.sizes), ",".join(map(str, self.sizes)), self.k, self.capture_seconds)

    def padded_size(self, num_reqs: int) -> int | None:
        return next((b for b in self.sizes if b >= num_reqs), None)

    def verify(self, b: int, num_reqs: int | None = None):
        """Replay: (hidden, taps, local logits, argmax, positions) of the b x (k + 1) tokens;
        an installed probe receives the first num_reqs requests' reports (layers/probes.py;
        None: all b)."""
        graph, *outputs = self.verify_graphs[b]
        graph.replay()
        self.reports.replay_to(("verify", b), b if num_reqs is None else num_reqs, b)
        return outputs

    def draft(self, b: int, num_reqs: int | None = None) -> torch.Tensor:
        """Replay after `last_index` / `last_token` are set: drafts [b, k] (reports as `verify`)."""
        graph, drafts = self.draft_graphs[b]
        graph.replay()
        self.reports.replay_to(("draft", b), b if num_reqs is None else num_reqs, b)
        return drafts
