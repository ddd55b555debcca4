"""The tracemalloc hook of a memory-leak hunt, on only with M3SERVE_DEBUG_TRACEMALLOC (envs):
tracing starts when a process starts; a reading is the bytes of Python objects still allocated
after a full garbage collection, optionally with the largest allocation sites, so that two
readings taken some thousand requests apart show what grew and where it was allocated.
"""
from __future__ import annotations

import gc
import linecache
import sys
import tracemalloc

GROUPS = ("lineno", "filename", "traceback")


def start(frames: int) -> bool:
    """Trace allocations with `frames` frames each (0: leave tracing off); True when tracing."""
    if frames > 0 and not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    return tracemalloc.is_tracing()


def traced_bytes() -> int:
    """Bytes still allocated by Python (0 when not tracing), after collecting cyclic garbage
    and emptying CPython's type-attribute cache and the source-line cache: each would read as
    growth that is not kept, the garbage until the collector runs, the type cache as it fills
    (its 4096 slots, keyed by the address of the name looked up, each hold on to the name: a
    string made afresh for each lookup, as zmq's socket options are, takes one more slot every
    time), the line cache once a warning or a logged traceback first reads a source file (it
    keeps the whole file, hundreds of KB for a large module)."""
    if not tracemalloc.is_tracing():
        return 0
    linecache.clearcache()
    sys._clear_type_cache()
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def reading(top: int = 0, group: str = "lineno") -> dict:
    """{"traced_bytes", "peak_bytes", "sites"}: `sites` holds the `top` largest allocation sites
    (grouped by line, file or whole traceback; most recent frame first) as {where, size, count}.
    The snapshot behind `sites` is dropped before returning, so it never shows in the next
    reading. ValueError for an unknown group."""
    if group not in GROUPS:
        raise ValueError(f"group must be one of {list(GROUPS)}, got {group!r}")
    current = traced_bytes()
    out = {"traced_bytes": current, "peak_bytes": tracemalloc.get_traced_memory()[1] if current else 0,
           "sites": []}
    if top > 0 and tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)])
        for stat in snapshot.statistics(group)[:top]:
            where = " <- ".join(str(frame) for frame in reversed(stat.traceback))
            out["sites"].append({"where": where, "size": stat.size, "count": stat.count})
        del snapshot
    return out
