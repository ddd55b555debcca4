"""How many Triton kernel variants the process has compiled so far, over every `@triton.jit`
kernel in `m3serve.kernels`: a benchmark reads it before and after a measured run to show that
no JIT compile happened inside it (a new specialisation costs hundreds of milliseconds)."""
from __future__ import annotations

import importlib
import pkgutil


def compiled_variants() -> int:
    import m3serve.kernels as pkg
    total = 0
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.ispkg:
            continue
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for obj in vars(module).values():
            caches = getattr(obj, "device_caches", None)   # triton JITFunction: device -> (kernels, ...)
            if isinstance(caches, dict):
                total += sum(len(entry[0]) for entry in caches.values())
    return total
