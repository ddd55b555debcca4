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


@pytest.mark.parametrize("m", [1, 3, 8])
def test_head_epilogue_real_vocabulary(m):
    """The lm_head's fp32 logits and argmax from the GEMM's epilogue equal the two-step path
    bit for bit (ties included: duplicated vocabulary rows), with and without a padded tail."""
    from m3serve.kernels.gemv import skinny_head, skinny_linear
    n, k = 200064, 6144
    g = torch.Generator(device="cuda").manual_seed(m)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w[150000] = w[7]
    w[9] = w[7]
    x[0] = w[7].float().mul(k ** 0.5).bfloat16()
    for num_real in (n, n - 100):
        logits, ids = skinny_head(x, w, num_real)
        want = skinny_linear(x, w).float()
        want[:, num_real:] = float("-inf")
        assert torch.equal(logits, want)
        assert torch.equal(ids, want.argmax(-1))
        assert ids[0] == 7


def test_lm_head_uses_the_epilogue_for_decode_batches():
    from m3serve.distributed import GroupInfo
    from m3serve.layers import dispatch
    from m3serve.model.minimax_m3 import ParallelLMHead
    head = ParallelLMHead(200064, 6144, GroupInfo(), torch.bfloat16).cuda()
    torch.nn.init.normal_(head.weight, std=6144 ** -0.5)
    for m in (1, 8, 9):
        dispatch.executed.clear()
        hidden = torch.randn(m, 6144, device="cuda").bfloat16()
        local, ids = head.logits_and_greedy(hidden)
        assert dispatch.executed[("skinny_head", "triton")] == (1 if m <= 8 else 0)
        want = head.local_logits(hidden)
        if m <= 8:
            assert torch.equal(local, want)
        assert torch.equal(ids, want.argmax(-1))
