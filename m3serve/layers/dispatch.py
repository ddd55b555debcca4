"""The one place that decides, per op, between a Triton kernel and its PyTorch reference, and
records which path actually ran (configured != eligible != executed).

Triton runs on CUDA tensors unless M3SERVE_FORCE_REFERENCE_OPS=1; the reference ops run on CPU.
`executed` counts (op, path) pairs as Python runs them (CUDA-graph replays are not recounted).
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch

from m3serve import envs

executed: Counter = Counter()
_forced_reference = False


@contextmanager
def reference_ops():
    """Run the PyTorch reference ops inside this block, whatever the device (for comparisons)."""
    global _forced_reference
    before, _forced_reference = _forced_reference, True
    try:
        yield
    finally:
        _forced_reference = before


def use_triton(op: str, x: torch.Tensor) -> bool:
    triton_ok = x.is_cuda and not envs.FORCE_REFERENCE_OPS and not _forced_reference
    executed[(op, "triton" if triton_ok else "reference")] += 1
    return triton_ok


def summary() -> dict[str, str]:
    """op -> the path(s) that ran, e.g. {"paged_attention": "triton"}."""
    paths: dict[str, set] = {}
    for (op, path), _ in executed.items():
        paths.setdefault(op, set()).add(path)
    return {op: "+".join(sorted(p)) for op, p in sorted(paths.items())}
