"""How many Triton kernel variants the process has compiled so far, over every `@triton.jit`
kernel in `m3serve.kernels`: a benchmark reads it before and after a measured run to show that
no JIT compile happened inside it (a new specialisation costs hundreds of milliseconds)."""
from __future__ import annotations

import importlib
import pkgutil


def variants_by_kernel() -> dict[str, int]:
    """Compiled variants per kernel name (which kernel a new specialisation came from)."""
    import m3serve.kernels as pkg
    counts: dict[str, int] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.ispkg:
            continue
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, obj in vars(module).items():
            caches = getattr(obj, "device_caches", None)   # triton JITFunction: device -> (kernels, ...)
            if isinstance(caches, dict):
                counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts


def new_variants(before: dict[str, int]) -> dict[str, int]:
    """Kernels that compiled variants since `before` (a `variants_by_kernel()`), and how many."""
    return {k: v - before.get(k, 0) for k, v in variants_by_kernel().items() if v > before.get(k, 0)}
