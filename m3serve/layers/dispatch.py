"""The one place that decides, per op, between a Triton kernel, its PyTorch reference and (for
the ops that have one) a CPU path, and records which path actually ran (configured != eligible
!= executed).

Triton runs on CUDA tensors unless M3SERVE_FORCE_REFERENCE_OPS=1; on CPU an op's CPU path runs
(`layers/cpu_attention.py`: the reference's fp64 math without the work that cannot change a
result), else its reference. M3SERVE_FORCE_REFERENCE_OPS=1 or `reference_ops()` runs the
references everywhere. `executed` counts (op, path) pairs as Python runs them (CUDA-graph
replays are not recounted).
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch

from m3serve import envs

executed: Counter = Counter()
_forced_reference: bool | frozenset = False


@contextmanager
def reference_ops(*ops: str):
    """Run the PyTorch reference ops inside this block, whatever the device (for comparisons):
    every op, or only the named ones (e.g. `reference_ops("moe")`, to find which op a
    difference comes from); nested blocks add to what the outer one forces."""
    global _forced_reference
    before = _forced_reference
    _forced_reference = True if before is True or not ops else frozenset(ops) | (before or frozenset())
    try:
        yield
    finally:
        _forced_reference = before


def select(op: str, x: torch.Tensor, has_cpu_path: bool = False) -> str:
    """The path `op` takes on `x`'s device: "triton", "cpu" (only where `has_cpu_path`) or
    "reference"; recorded in `executed`."""
    forced = _forced_reference is True or (bool(_forced_reference) and op in _forced_reference)
    if envs.FORCE_REFERENCE_OPS or forced:
        path = "reference"
    elif x.is_cuda:
        path = "triton"
    else:
        path = "cpu" if has_cpu_path and x.device.type == "cpu" else "reference"
    executed[(op, path)] += 1
    return path


def use_triton(op: str, x: torch.Tensor) -> bool:
    return select(op, x) == "triton"


def summary() -> dict[str, str]:
    """op -> the path(s) that ran, e.g. {"paged_attention": "triton"}."""
    paths: dict[str, set] = {}
    for (op, path), _ in executed.items():
        paths.setdefault(op, set()).add(path)
    return {op: "+".join(sorted(p)) for op, p in sorted(paths.items())}
