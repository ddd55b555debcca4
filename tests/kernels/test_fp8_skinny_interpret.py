"""CPU interpreter tests of the FP8 skinny GEMM (kernels/gemv.py `skinny_fp8_linear`): its fused
per-token activation quantisation gives the operands `quant_rows_fp8_ref` gives, and the product
equals the fp64 product of those dequantised operands within fp32 accumulation, for 1-16 rows and
ragged N and K; bad operands are refused by name."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels.gemv import skinny_fp8_eligible, skinny_fp8_linear  # noqa: E402
from m3serve.kernels.ref.fused_moe import quant_rows_fp8_ref  # noqa: E402
from m3serve.layers.quant import quantize_weight  # noqa: E402


@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (4, 100, 300), (8, 70, 513), (16, 33, 1000)])
def test_equals_the_quantised_reference(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 5).to(torch.bfloat16)
    x[0, 3] = 40.0                                  # one large value sets a row's scale
    wq, ws = quantize_weight(torch.randn(n, k, generator=g).to(torch.bfloat16))
    got = skinny_fp8_linear(x, wq, ws, {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1})
    xq, xs = quant_rows_fp8_ref(x)
    exact = (xq.double() @ wq.double().T) * xs.double()[:, None] * ws.double()[None, :]
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # fp32 accumulation and two fp32 scalings: within one bf16 ulp of the exact value
    ulp = exact.abs().clamp_min(xs.double()[:, None] * ws.double()[None, :]) * 2.0 ** -7
    assert ((got.double() - exact).abs() <= ulp).all()
    # and the quantised operands are the reference's: a row quantised alone gives the same
    row = skinny_fp8_linear(x[1:2], wq, ws, {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}) \
        if m > 1 else got
    assert torch.equal(row[0], got[1 if m > 1 else 0])


def test_zero_rows_keep_the_minimum_scale_and_bad_input_is_named():
    wq, ws = quantize_weight(torch.randn(48, 256).to(torch.bfloat16))
    got = skinny_fp8_linear(torch.zeros(2, 256, dtype=torch.bfloat16), wq, ws,
                            {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1})
    assert torch.equal(got, torch.zeros(2, 48, dtype=torch.bfloat16))
    assert not skinny_fp8_eligible(torch.empty(17, 256, dtype=torch.bfloat16), wq)
    assert not skinny_fp8_eligible(torch.empty(1, 256, dtype=torch.bfloat16), wq.to(torch.bfloat16))
    with pytest.raises(ValueError, match="FP8 skinny GEMM needs"):
        skinny_fp8_linear(torch.empty(17, 256, dtype=torch.bfloat16), wq, ws)
    with pytest.raises(ValueError, match="w_scale"):
        skinny_fp8_linear(torch.empty(1, 256, dtype=torch.bfloat16), wq, ws[:3])
