"""CUDA graphs of the speculative decode step: every request verifies the same number j of
drafts (j + 1 query tokens, the graph's query width q), padded to a capture size b.

- verify(b, q): the target forward over the staged b x q tokens -> final hidden states, the
  tapped streams (EAGLE3), this rank's logits and their argmax, for every token;
- draft(b, q): from each request's last verified position (`last_index`) and the token after it
  (`last_token`), both written on the device between the two replays, the proposer's first pass
  over the step's tokens and its k - 1 one-token steps -> drafts [b, k].
Acceptance is decided on the device between the replays (greedy: the leading run of drafts
equal to the argmax; sampled: the rejection sampler), so a step costs one host sync, for the
emitted tokens and the next drafts together. Query width 1 is the switch step (speculating, no
drafts yet: the first step with drafts after plain steps), which only proposes.

Which pairs are captured is `spec_graph_plan`: every capture size, at every query width the
engine's rule for which steps speculate may use (`spec_graph_widths`).
"""
from __future__ import annotations

import logging
import time

import torch

from m3serve.core.spec_gate import draft_widths
from m3serve.layers import probes

logger = logging.getLogger(__name__)


def spec_graph_widths(k: int, rule: str) -> list[int]:
    """Query widths (drafts verified + 1) of the speculative steps under `rule`
    (`SpeculationGate.rule`), widest first: k + 1; the switch step's 1 where plain steps occur
    (fixed, measured); and under the measured rule every width of `draft_widths(k)`."""
    widths = {k + 1}
    if rule in ("fixed", "measured"):
        widths.add(1)
    if rule == "measured":
        widths.update(w + 1 for w in draft_widths(k))
    return sorted(widths, reverse=True)


def spec_graph_plan(sizes: list[int], widths: list[int]) -> list[tuple[int, int]]:
    """(batch size, query width) of every verify + draft graph pair, in capture order: the most
    tokens first, so that the later ones reuse its memory pool."""
    return sorted(((b, q) for b in sizes for q in widths), key=lambda p: (-p[0] * p[1], -p[1], -p[0]))


class SpecDecodeGraphs:
    def __init__(self, model, proposer, buffers, sizes: list[int], k: int, max_model_len: int,
                 widths: list[int] | None = None):
        """`widths`: the query widths to capture (`spec_graph_widths`; None: k + 1 only)."""
        self.model, self.proposer, self.buffers = model, proposer, buffers
        self.sizes, self.k = sorted(sizes), k
        self.widths = sorted(widths or [k + 1], reverse=True)
        self.max_seq_len = max_model_len + k
        dev = buffers.dev.device
        bmax = self.sizes[-1]
        self.last_index = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.last_token = torch.zeros(bmax, dtype=torch.int64, device=dev)
        # (b, q) -> (graph, hidden, taps, local, greedy, positions) / (graph, drafts)
        self.verify_graphs: dict[tuple[int, int], tuple] = {}
        self.draft_graphs: dict[tuple[int, int], tuple] = {}
        self.reports = probes.GraphReports()        # layers/probes.py reports, replayed to a probe
        self.capture_seconds = 0.0

    def _inputs(self, b: int, q: int, seq_lens_cpu: list[int] | None):
        T = b * q
        return self.buffers.inputs(b, T, q == 1, list(range(0, T + 1, q)), seq_lens_cpu or [q] * b,
                                   max_query_len=q, max_seq_len=self.max_seq_len)

    def verify_forward(self, b: int, q: int, seq_lens_cpu: list[int] | None = None):
        ids, positions, meta = self._inputs(b, q, seq_lens_cpu)
        taps = self.proposer.taps
        out = self.model(ids, positions, meta, taps)
        hidden, tapped = out if taps else (out, out)
        local, greedy = self.model.lm_head.logits_and_greedy(hidden)
        return hidden, tapped, local, greedy, positions

    def draft_forward(self, b: int, q: int, hidden_in: torch.Tensor, seq_lens_cpu: list[int] | None = None,
                      last_positions_cpu: list[int] | None = None) -> torch.Tensor:
        ids, positions, meta = self._inputs(b, q, seq_lens_cpu)
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
        pool = torch.cuda.graph_pool_handle()
        plan = spec_graph_plan(self.sizes, self.widths)
        for b, q in plan:
            # padding rows of q tokens each, as the captured kernels will read them
            self.buffers.stage(None, input_batch, pad_to=self.sizes[-1], pad_query_len=q)
            self.last_index[:b] = torch.arange(b, device=self.last_index.device) * q
            with probes.installed(None):
                for _ in range(2):                 # warm-up: compile kernels, settle the allocator
                    _, tapped, *_ = self.verify_forward(b, q)
                    self.draft_forward(b, q, tapped)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with self.reports.collect(("verify", b, q)), torch.cuda.graph(graph, pool=pool):
                outputs = self.verify_forward(b, q)
            self.verify_graphs[b, q] = (graph, *outputs)
            graph = torch.cuda.CUDAGraph()
            with self.reports.collect(("draft", b, q)), torch.cuda.graph(graph, pool=pool):
                drafts = self.draft_forward(b, q, outputs[1])
            self.draft_graphs[b, q] = (graph, drafts)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d speculative verify + draft CUDA graph pairs (batch %s, query width %s: %s "
                    "drafts verified, k %d) in %.1f s", len(plan), ",".join(map(str, self.sizes)),
                    ",".join(map(str, self.widths)), ",".join(str(q - 1) for q in self.widths), self.k,
                    self.capture_seconds)

    def padded_size(self, num_reqs: int) -> int | None:
        return next((b for b in self.sizes if b >= num_reqs), None)

    def verify(self, b: int, q: int, num_reqs: int | None = None):
        """Replay: (hidden, taps, local logits, argmax, positions) of the b x q tokens; an
        installed probe receives the first num_reqs requests' reports (layers/probes.py; None:
        all b)."""
        graph, *outputs = self.verify_graphs[b, q]
        graph.replay()
        self.reports.replay_to(("verify", b, q), b if num_reqs is None else num_reqs, b)
        return outputs

    def draft(self, b: int, q: int, num_reqs: int | None = None) -> torch.Tensor:
        """Replay after `last_index` / `last_token` are set: drafts [b, k] (reports as `verify`)."""
        graph, drafts = self.draft_graphs[b, q]
        graph.replay()
        self.reports.replay_to(("draft", b, q), b if num_reqs is None else num_reqs, b)
        return drafts
