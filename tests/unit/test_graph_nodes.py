"""Reading a captured CUDA graph's nodes (worker/graph_nodes.py): the classification and the
summary on CPU; on a GPU, a captured graph of known work read back through the driver."""
import pytest
import torch

from m3serve.worker.graph_nodes import kernel_class, summarize_nodes


def test_kernel_classes():
    assert kernel_class("fused_moe_kernel") == "moe"
    assert kernel_class("_paged_sparse_attention_decode") == "attention"
    assert kernel_class("_rmsnorm_fwd") == "norm_rope"
    assert kernel_class("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "gemm"
    assert kernel_class("_one_shot_all_reduce") == "all_reduce"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert kernel_class("mystery") == "other" and kernel_class(None) == "unnamed"


def test_summary_counts_kernels_not_copies():
    nodes = [("kernel", "fused_moe_kernel"), ("memset", None), ("kernel", "_rmsnorm_fwd"),
             ("memcpy", None), ("kernel", "fused_moe_kernel")]
    s = summarize_nodes(nodes, num_layers=2)
    assert s["kernels"] == 3 and s["kernels_per_layer"] == 1.5
    assert s["nodes_by_type"] == {"kernel": 3, "memcpy": 1, "memset": 1}
    assert s["kernels_by_class"] == {"moe": 2, "norm_rope": 1}
    assert s["kernels_by_name"] == {"fused_moe_kernel": 2, "_rmsnorm_fwd": 1}


def test_short_names_drop_templates_and_arguments():
    from m3serve.worker.graph_nodes import short_name
    name = "void at::native::vectorized_elementwise_kernel<4, at::native::Foo<float>>(int, float)"
    assert short_name(name) == "void at::native::vectorized_elementwise_kernel"
    assert short_name("_rmsnorm_fwd") == "_rmsnorm_fwd" and short_name(None) == "?"
    assert len(short_name("x" * 200)) == 72


@pytest.mark.gpu
def test_captured_graph_read_back():
    """A graph of a matmul, an add and a memset: three kernel-or-memset nodes read back with
    types, the matmul named as a gemm; replay still gives the right result after instantiate."""
    from m3serve.worker.graph_nodes import graph_nodes
    a = torch.randn(64, 64, device="cuda")
    out = torch.empty(64, 64, device="cuda")
    z = torch.empty(1024, device="cuda")
    torch.matmul(a, a, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        torch.matmul(a, a, out=out)
        out.add_(1.0)
        z.zero_()
    nodes = graph_nodes(g.raw_cuda_graph())
    g.instantiate()
    kinds = [t for t, _ in nodes]
    assert kinds.count("kernel") + kinds.count("memset") == 3, nodes
    names = [n for t, n in nodes if t == "kernel"]
    assert all(names), nodes
    assert any(kernel_class(n) == "gemm" for n in names), names
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, a @ a + 1.0, atol=1e-3)
