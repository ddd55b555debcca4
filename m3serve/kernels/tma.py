"""Whether Triton's tensor-descriptor (TMA) loads can run on a device, and the global-memory
allocator the in-kernel descriptors need (one small scratch tensor per launch)."""
from __future__ import annotations

import os

import torch
import triton


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_ready(device: torch.device) -> bool:
    """True on a Hopper or newer GPU outside the interpreter. Installs the allocator on every
    call: Triton keeps it per thread (a context variable), and a launch from a thread without
    one fails."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    triton.set_allocator(_scratch)
    return True
