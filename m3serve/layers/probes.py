"""The forward's one instrumentation hook: layers report intermediate tensors that tests and
benchmarks want to see (which blocks an MSA layer attended to, which experts an MoE layer
routed each token to) to the probe installed here, and to nothing when none is.

Contract:
- `active` is the installed probe or None. A reporting layer checks it first, so with no probe
  a forward pays one module attribute read per report site and builds nothing:
      if probes.active is not None:
          probes.active.record(probes.ROUTED_EXPERTS, self.layer_id, ids)
- `record(name, layer_id, tensor)` receives the layer's own tensor (no copy) in forward order.
  Layer ids are the decoder layer's index; the MTP modules' layers report as
  `num_hidden_layers + m`, so draft and target never share an id.
- Under CUDA graphs Python does not run at replay. `GraphReports` collects what the layers
  report while a graph is captured (those tensors are the graph's static outputs) and, after
  each replay, reports them again to the installed probe, cut to the step's real requests
  (with a DP exchange the decode graphs keep every row, as the eager MoE does): views of static
  buffers, overwritten by the next replay, so a probe that keeps them past the step must clone
  them. The capture's warm-up forwards report to no one.
- A probe lives in one process: under TP each rank reports its own shard to its own probe (the
  selected blocks of its KV groups; the routed experts, which every rank computes alike); with
  several DP replicas an MoE layer reports the expert ids of every replica's tokens, padding
  rows included.

Names: `SPARSE_BLOCKS` ([T, G_local, topk] logical block ids per KV group, -1 padded, int32)
and `ROUTED_EXPERTS` ([T, K] global expert ids).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol

import torch

SPARSE_BLOCKS = "sparse_blocks"
ROUTED_EXPERTS = "routed_experts"


class Probe(Protocol):
    def record(self, name: str, layer_id: int, tensor: torch.Tensor) -> None: ...


active: Probe | None = None


@contextmanager
def installed(probe: Probe | None) -> Iterator[Probe | None]:
    """Install `probe` for the duration of the block (None: no probe); the previous one is
    restored after."""
    global active
    before, active = active, probe
    try:
        yield probe
    finally:
        active = before


class Recorder:
    """A probe that keeps what is reported: `latest(name)` the last tensor of each layer, and with
    `keep_all` also `tensors(name)` every report in forward order (a list that grows each step)."""

    def __init__(self, keep_all: bool = True):
        self.keep_all = keep_all
        self._latest: dict[str, dict[int, torch.Tensor]] = {}
        self._all: dict[str, list[torch.Tensor]] = {}

    def record(self, name: str, layer_id: int, tensor: torch.Tensor) -> None:
        self._latest.setdefault(name, {})[layer_id] = tensor
        if self.keep_all:
            self._all.setdefault(name, []).append(tensor)

    def latest(self, name: str) -> dict[int, torch.Tensor]:
        """layer id -> the last tensor that layer reported under `name`."""
        return dict(self._latest.get(name, {}))

    def tensors(self, name: str) -> list[torch.Tensor]:
        """Every tensor reported under `name`, in order (needs keep_all)."""
        if not self.keep_all:
            raise ValueError("this Recorder keeps only the latest report per layer (keep_all=False)")
        return list(self._all.get(name, []))


class GraphReports:
    """What the layers report while CUDA graphs are captured, per graph key, for `replay_to`.

    Inside `collect(key)` the collector is the installed probe (a probe installed by the caller
    is set aside, so the capture's warm-up and padding rows never reach it)."""

    def __init__(self):
        self._reports: dict[object, list[tuple[str, int, torch.Tensor]]] = {}

    @contextmanager
    def collect(self, key) -> Iterator[None]:
        reports = self._reports[key] = []

        class _Collector:
            def record(self, name, layer_id, tensor):
                reports.append((name, layer_id, tensor))

        with installed(_Collector()):
            yield

    def reports(self, key) -> list[tuple[str, int, torch.Tensor]]:
        """(name, layer id, tensor) of graph `key`, in forward order."""
        return list(self._reports.get(key, ()))

    def replay_to(self, key, num_reqs: int, padded_reqs: int) -> None:
        """After graph `key` (captured for `padded_reqs` requests) replayed over `num_reqs` real
        ones: report its captured tensors to the installed probe (nothing to do without one),
        each cut to the real requests' share of its rows (rows per request are fixed and the
        padding requests come last; pass num_reqs = padded_reqs to keep every row)."""
        probe = active
        if probe is None:
            return
        for name, layer_id, tensor in self._reports.get(key, ()):
            probe.record(name, layer_id, tensor[:tensor.shape[0] * num_reqs // padded_reqs])
