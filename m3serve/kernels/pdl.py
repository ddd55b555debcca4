"""Programmatic dependent launch (PDL) for the decode kernels.

A kernel launched with PDL may start while the kernel before it on the stream is still running:
its programs first wait until the kernel before them has finished and its writes are visible
(`griddepcontrol.wait`), then tell the runtime that the kernel after them may launch
(`griddepcontrol.launch_dependents`), so at most one kernel waits ahead of the running one.
What overlaps is a launch's latency and a program's start with the previous kernel's work;
inside a CUDA graph the
launches become programmatic edges. Kernels that take part call `pdl_start(PDL)` before their
first load and are launched with `**launch_options(on)`; a kernel after one that does not
trigger (cuBLAS) simply starts when that one ends.

M3SERVE_PDL=1 turns it on (Hopper and newer, where this Triton supports it; never under the
interpreter); off by default: measured slower at the rank (docs/performance.md).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from m3serve import envs

try:
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    SUPPORTED = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
except ImportError:                      # an older Triton: no PDL
    SUPPORTED = False

if not SUPPORTED:
    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First thing in a kernel that may be launched with PDL: wait for the previous kernel (its
    writes visible), then let the next one launch. Nothing when PDL is False. (The other order
    lets the whole chain launch before the first kernel has finished; at one TP 8 rank both
    orders measured about 0.9-1 ms slower a decode step than no PDL, docs/performance.md.)"""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels launched on x's device use PDL."""
    return (envs.PDL and SUPPORTED and x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and _device_supports(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def launch_options(on: bool) -> dict:
    """The launch keywords for a kernel that calls `pdl_start(PDL=on)`."""
    return {"launch_pdl": True} if on else {}
