"""What a captured CUDA graph holds, read from the graph itself through the CUDA driver
(`libcuda`): its nodes by type and its kernels by name and class. The benches report kernels per
decode step and per layer from this (a graph replay launches exactly these nodes), rather than
from a profiler trace of one replay.

`summarize(raw_graph, num_layers)` takes the `cudaGraph_t` of a graph captured with
`torch.cuda.CUDAGraph(keep_graph=True)` (`raw_cuda_graph()`); it raises OSError where the driver
or one of its entry points is missing (CPU machines, old drivers), which callers treat as
"not counted".
"""
from __future__ import annotations

import ctypes
import re
from collections import Counter
from functools import lru_cache

# CUgraphNodeType, as numbered by the driver API
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
              6: "wait_event", 7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait",
              10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}

# kernel name (demangled or not) -> class, first match wins; the classes of the decode-step
# profile in docs/performance.md
KERNEL_CLASSES = [
    ("moe", r"moe|expert|route|align_block|swiglu"),
    ("attention", r"attention|attn|flash|fmha|paged|sparse_decode|merge_state"),
    ("index", r"indexer|index_score|topk|top_k"),
    ("norm_rope", r"rms_?norm|layer_?norm|rope|rotary|qk_norm"),
    ("all_reduce", r"all_?reduce|nccl|one_shot|two_shot"),
    ("gemm", r"gemm|gemv|cutlass|xmma|nvjet|sm90_|cublas|matmul|_mm_|packed|w8a8|scaled_mm"),
    ("sampling", r"argmax|sampl|softmax|logit"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce_kernel|cat_|copy|fill|index_select|gather|scatter"),
]
_CLASS_RES = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in KERNEL_CLASSES]


def kernel_class(name: str | None) -> str:
    """One kernel's class by its name; "other" when no rule matches, "unnamed" without a name."""
    if not name:
        return "unnamed"
    for cls, pattern in _CLASS_RES:
        if pattern.search(name):
            return cls
    return "other"


class _KernelNodeParams(ctypes.Structure):
    # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(f"{what} failed with CUresult {result}")


def _kernel_name(lib: ctypes.CDLL, node: ctypes.c_void_p) -> str | None:
    params = _KernelNodeParams()
    try:
        _check(lib.cuGraphKernelNodeGetParams_v2(node, ctypes.byref(params)), "cuGraphKernelNodeGetParams_v2")
    except (OSError, AttributeError):
        return None
    name = ctypes.c_char_p()
    for getter, handle in (("cuFuncGetName", params.func), ("cuKernelGetName", params.kern)):
        if handle and hasattr(lib, getter) and getattr(lib, getter)(ctypes.byref(name), ctypes.c_void_p(handle)) == 0:
            return name.value.decode(errors="replace") if name.value else None
    return None


def graph_nodes(raw_graph: int) -> list[tuple[str, str | None]]:
    """(node type, kernel name or None) of every node of a `cudaGraph_t`, in the driver's order."""
    lib = _driver()
    graph = ctypes.c_void_p(raw_graph)
    count = ctypes.c_size_t(0)
    _check(lib.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(lib.cuGraphGetNodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    out = []
    for node in nodes[:count.value]:
        kind = ctypes.c_int(-1)
        _check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        type_name = NODE_TYPES.get(kind.value, f"type{kind.value}")
        out.append((type_name, _kernel_name(lib, ctypes.c_void_p(node)) if type_name == "kernel" else None))
    return out


def summarize_nodes(nodes: list[tuple[str, str | None]], num_layers: int) -> dict:
    """{"kernels": n, "kernels_per_layer": n / num_layers, "nodes_by_type": {...},
    "kernels_by_class": {...}, "kernels_by_name": {short name: count}} of a graph's nodes; copies
    and memsets are nodes, not kernels."""
    types = Counter(t for t, _ in nodes)
    names = [name for t, name in nodes if t == "kernel"]
    classes = Counter(kernel_class(name) for name in names)
    kernels = types.get("kernel", 0)
    return {"kernels": kernels, "kernels_per_layer": round(kernels / num_layers, 2) if num_layers else None,
            "nodes_by_type": dict(sorted(types.items())), "kernels_by_class": dict(classes.most_common()),
            "kernels_by_name": dict(Counter(short_name(n) for n in names).most_common())}


def short_name(name: str | None, width: int = 72) -> str:
    """A kernel name cut to its function's name (C++ templates and arguments dropped) and to
    `width` characters; "?" without a name."""
    if not name:
        return "?"
    base = name.split("(")[0]
    depth, out = 0, []
    for ch in base:                      # drop template arguments
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    return "".join(out).strip()[:width] or name[:width]


def summarize(raw_graph: int, num_layers: int) -> dict:
    """`summarize_nodes` of a captured graph (see the module docstring)."""
    return summarize_nodes(graph_nodes(raw_graph), num_layers)
