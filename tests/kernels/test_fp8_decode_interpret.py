"""CPU interpreter tests of the split-K FP8 decode GEMM (kernels/fp8_decode.py): against the
exact product of the operands `quant_rows_fp8_ref` and the weight quantisation give, within one
bf16 ulp, for 1-16 rows, ragged N and K and several K splits; a row's result does not depend on
the other rows of its batch; bad operands are refused by name."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels.fp8_decode import fp8_decode_config, fp8_decode_eligible, fp8_decode_linear  # noqa: E402
from m3serve.kernels.ref.fused_moe import quant_rows_fp8_ref  # noqa: E402
from m3serve.layers.quant import quantize_weight  # noqa: E402


def _operands(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 5).to(torch.bfloat16)
    x[0, 3] = 40.0                                  # one large value sets a row's scale
    wq, ws = quantize_weight(torch.randn(n, k, generator=g).to(torch.bfloat16))
    return x, wq, ws


def _exact(x, wq, ws):
    xq, xs = quant_rows_fp8_ref(x)
    return (xq.double() @ wq.double().T) * xs.double()[:, None] * ws.double()[None, :], xs


@pytest.mark.parametrize("m,n,k,per", [(1, 64, 256, 64), (4, 100, 300, 128), (8, 70, 513, 256),
                                       (16, 33, 1000, 1024)])
def test_equals_the_exact_quantised_product(m, n, k, per):
    x, wq, ws = _operands(m, n, k, m * n + k)
    cfg = {"BLOCK_N": 32, "BLOCK_K": 64, "k_per_split": per, "num_warps": 4, "num_stages": 1}
    got = fp8_decode_linear(x, wq, ws, cfg)
    exact, xs = _exact(x, wq, ws)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    ulp = exact.abs().clamp_min(xs.double()[:, None] * ws.double()[None, :]) * 2.0 ** -7
    assert ((got.double() - exact).abs() <= ulp).all()


def test_a_row_does_not_depend_on_its_batch():
    x, wq, ws = _operands(6, 96, 700, 3)
    cfg = {"BLOCK_N": 32, "BLOCK_K": 64, "k_per_split": 192, "num_warps": 4, "num_stages": 1}
    batch = fp8_decode_linear(x, wq, ws, cfg)
    for i in (0, 5):
        assert torch.equal(fp8_decode_linear(x[i:i + 1].contiguous(), wq, ws, cfg)[0], batch[i])


def test_config_splits_narrow_weights():
    qkv = fp8_decode_config(1232, 6144)                 # a TP 8 rank's fused qkv: 20 column tiles
    assert qkv["BLOCK_N"] == 64 and 6144 // qkv["k_per_split"] >= 8
    wide = fp8_decode_config(9856, 6144)
    assert wide["k_per_split"] >= qkv["k_per_split"]


def test_bad_operands_are_named():
    wq, ws = quantize_weight(torch.randn(48, 256).to(torch.bfloat16))
    assert not fp8_decode_eligible(torch.empty(17, 256, dtype=torch.bfloat16), wq)
    assert not fp8_decode_eligible(torch.empty(1, 256, dtype=torch.bfloat16), wq.to(torch.bfloat16))
    with pytest.raises(ValueError, match="FP8 decode GEMM needs"):
        fp8_decode_linear(torch.empty(17, 256, dtype=torch.bfloat16), wq, ws)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_decode_linear(torch.empty(1, 256, dtype=torch.bfloat16), wq, ws[:3])
