"""Whether Triton's tensor-descriptor (TMA) loads can run on a device, and the global-memory
allocator the in-kernel descriptors need (one small scratch tensor per launch)."""
from __future__ import annotations

import os

import torch
import triton

_allocator_set = False


def tma_ready(device: torch.device) -> bool:
    """True on a Hopper or newer GPU outside the interpreter; installs the allocator once."""
    global _allocator_set
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    if not _allocator_set:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                     device="cuda"))
        _allocator_set = True
    return True
