"""The skinny GEMM on a GPU at MiniMax-M3's decode shapes (fused qkv, o_proj, dense MLP, lm_head;
1-8 rows), against an fp64 product rounded once, and `linear` choosing it only for <= 8 rows and
weights of at least 4096 x 4096."""
import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [(9856, 6144), (6144, 8192), (24576, 6144), (6144, 12288), (200064, 6144)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_real_shapes(n, k, m):
    from m3serve.kernels.gemv import skinny_linear
    g = torch.Generator(device="cuda").manual_seed(n + m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    ref = x.double() @ w.double().T
    got = skinny_linear(x, w)
    ulp = ref.abs().clamp_min(2.0 ** -6) * 2.0 ** -7
    assert ((got.double() - ref).abs() <= ulp).all()
    cublas = torch.nn.functional.linear(x, w)
    assert ((cublas.double() - ref).abs() <= ulp).all()   # the bound holds for cuBLAS too


def test_linear_routes_decode_shapes_only():
    from m3serve.layers import dispatch
    from m3serve.layers.linear import linear
    w = torch.randn(6144, 8192, device="cuda").bfloat16()
    dispatch.executed.clear()
    linear(torch.randn(8, 8192, device="cuda").bfloat16(), w)
    assert dispatch.executed[("skinny_gemm", "triton")] == 1
    linear(torch.randn(9, 8192, device="cuda").bfloat16(), w)
    linear(torch.randn(1, 1024, device="cuda").bfloat16(), w[:, :1024].contiguous())
    assert dispatch.executed[("skinny_gemm", "triton")] == 1
