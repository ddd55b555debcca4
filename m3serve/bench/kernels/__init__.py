"""Kernel micro-benchmarks (run on a GPU: `python -m m3serve.bench.kernels.<op>`)."""
import torch


def graph_ms(fn) -> float:
    """GPU time of fn replayed from a CUDA graph (capture fails if fn syncs with the host)."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay)
