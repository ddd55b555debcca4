"""CPU interpreter tests of the Triton skinny GEMM (kernels/gemv.py): 1-16 rows, ragged N and K
(masked tails), against an fp64 product rounded once; and the shapes `linear` routes to it."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels.gemv import skinny_eligible, skinny_linear  # noqa: E402


@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (3, 100, 300), (8, 70, 513), (16, 33, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_fp64_rounded_once(m, n, k, dtype):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    ref = (x.double() @ w.double().T)
    got = skinny_linear(x, w, {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1})
    assert got.dtype == dtype and got.shape == (m, n)
    # fp32 accumulation of unit-variance products: well inside one output ulp of the fp64 sum
    ulp = ref.abs().clamp_min(1.0) * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)
    assert ((got.double() - ref).abs() <= ulp).all()


def test_strided_rows_and_bad_input():
    x = torch.randn(4, 2 * 256).to(torch.bfloat16)[:, :256]          # row stride 512
    w = torch.randn(48, 256).to(torch.bfloat16)
    got = skinny_linear(x, w, {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1})
    torch.testing.assert_close(got.float(), (x.float() @ w.float().T), atol=0.1, rtol=1e-2)
    with pytest.raises(ValueError, match="skinny GEMM needs"):
        skinny_linear(torch.randn(17, 256).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="one dtype"):
        skinny_linear(x.half(), w)


def test_eligible_shapes():
    w = torch.empty(6144, 8192, dtype=torch.bfloat16)
    assert skinny_eligible(torch.empty(1, 8192, dtype=torch.bfloat16), w)
    assert skinny_eligible(torch.empty(8, 8192, dtype=torch.bfloat16), w)
    assert not skinny_eligible(torch.empty(9, 8192, dtype=torch.bfloat16), w)             # cuBLAS
    assert not skinny_eligible(torch.empty(1, 8192, dtype=torch.float32), w)
    assert not skinny_eligible(torch.empty(1, 1024, dtype=torch.bfloat16),
                               torch.empty(6144, 1024, dtype=torch.bfloat16))              # TP shard


@pytest.mark.parametrize("m,n,k,num_real", [(1, 200, 256, 200), (5, 300, 130, 257), (16, 64, 64, 1)])
def test_head_logits_and_argmax(m, n, k, num_real):
    from m3serve.kernels.gemv import skinny_head
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    w[n // 2] = w[3]                     # equal maxima across tiles: the lowest column wins
    w[4] = w[3]                          # and inside one tile
    x[0] = w[3] * 4
    cfg = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
    logits, ids = skinny_head(x, w, num_real, cfg)
    want = skinny_linear(x, w, cfg).float()
    want[:, num_real:] = float("-inf")
    assert logits.dtype == torch.float32 and torch.equal(logits, want)
    assert ids.dtype == torch.int64 and torch.equal(ids, want.argmax(-1))
    if num_real > 3:
        assert ids[0] == 3
    with pytest.raises(ValueError, match="num_real"):
        skinny_head(x, w, n + 1, cfg)


def test_head_kernels_compile_for_hopper(tmp_path):
    """The skinny GEMM with and without the head epilogue, and the argmax finish, compile for
    sm_90 with the bundled ptxas (no GPU needed)."""
    from test_rmsnorm import compile_for_hopper
    tiles = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "UPCAST": False}
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "best_v_ptr": "*fp32", "best_i_ptr": "*i32"}
    jobs = [["m3serve.kernels.gemv", "_skinny_kernel", {**sig, "out_ptr": "*fp32"}, {**tiles, "HEAD": True}, 4],
            ["m3serve.kernels.gemv", "_skinny_kernel", {**sig, "out_ptr": "*bf16"}, {**tiles, "HEAD": False}, 4],
            ["m3serve.kernels.gemv", "_argmax_finish_kernel",
             {"best_v_ptr": "*fp32", "best_i_ptr": "*i32", "ids_ptr": "*i64"}, {"BLOCK": 4096}, 4]]
    assert len(compile_for_hopper(jobs, tmp_path)) == 3
