"""The split-K FP8 decode GEMM on a GPU (kernels/fp8_decode.py) at MiniMax-M3's fused qkv and
o_proj, cut to a TP 8 and a TP 4 rank and whole, 1-16 rows: within one bf16 ulp of the exact
product of the quantised operands (cuBLAS's `_scaled_mm` on the same operands is timed beside it
by scripts/fp8_linear_bench.py); a row's result does not depend on its batch; it replays in a
CUDA graph."""
import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [(1232, 6144), (2464, 6144), (9856, 6144), (6144, 1024), (6144, 2048), (6144, 8192)]


def _case(n, k, m, seed):
    from m3serve.layers.quant import quantize_weight
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    wq, ws = quantize_weight((torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16())
    return x, wq, ws


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_real_shapes(n, k, m):
    from m3serve.kernels.fp8_decode import fp8_decode_linear
    from m3serve.kernels.fused_moe import quant_rows_fp8
    x, wq, ws = _case(n, k, m, n + m)
    xq, xs = quant_rows_fp8(x)
    exact = (xq.double() @ wq.double().T) * xs.double()[:, None] * ws.double()[None, :]
    ulp = exact.abs().clamp_min(2.0 ** -6) * 2.0 ** -7
    got = fp8_decode_linear(x, wq, ws)
    assert ((got.double() - exact).abs() <= ulp).all()
    single = fp8_decode_linear(x[-1:].contiguous(), wq, ws)
    assert torch.equal(single[0], got[-1])


def test_graph_replay():
    from m3serve.kernels.fp8_decode import fp8_decode_linear
    x, wq, ws = _case(1232, 6144, 4, 7)
    want = fp8_decode_linear(x, wq, ws)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_decode_linear(x, wq, ws)
    x.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_decode_linear(x, wq, ws)) and not torch.equal(out, want)
