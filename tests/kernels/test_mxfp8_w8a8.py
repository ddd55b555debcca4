"""The MXFP8 product with FP8 activations (`kernels/mxfp8_w8a8.py`) on a GPU at MiniMax-M3's
widths (one TP 8 rank's and the full model's) and prefill row counts, against
`ref/packed.w8a8_reference` in fp32, and through `packed_linear` with the opt-in on."""
import pytest
import torch

pytestmark = pytest.mark.gpu

# (N, K): fused qkv of a sparse layer, o_proj, dense gate_up and down, shared expert gate_up and
# down at one TP 8 rank; fused qkv and o_proj at full width
SHAPES = [(1536, 6144), (6144, 1024), (3072, 6144), (6144, 1536), (768, 6144), (6144, 384),
          (12288 + 2048, 6144), (6144, 8192)]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("n,k", SHAPES)
def test_w8a8_equals_reference(n, k):
    from m3serve.kernels.mxfp8_w8a8 import mxfp8_w8a8_matmul
    from m3serve.kernels.ref import packed as rp
    g = torch.Generator(device="cuda").manual_seed(n + k)
    codes, scales = rp.quantize_mxfp8(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    w = rp.dequantize("mxfp8", codes, scales)
    for rows in (256, 300, 2048):
        x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
        out = mxfp8_w8a8_matmul(x, codes, scales)
        ref = rp.w8a8_reference(x, codes, scales)
        # bf16 outputs (2^-9) and the GPU's fp32 division in the row quantiser (an element on an
        # e4m3 rounding boundary may land one step away)
        assert out.dtype == torch.bfloat16 and _rel(out, ref) < 4e-3, (rows, _rel(out, ref))
        # FP8 activations move the product by e4m3's rounding (~2-3 % of each element), no more
        assert _rel(out, x.float() @ w.t()) < 0.05


def test_packed_linear_takes_w8a8_when_opted_in(monkeypatch):
    from torch import nn

    from m3serve import envs
    from m3serve.kernels.ref import packed as rp
    from m3serve.layers import dispatch
    from m3serve.layers.packed import MXFP8, W8A8_MIN_ROWS, packed_linear, set_packed_
    m = nn.Module()
    set_packed_(m, "weight", MXFP8, *rp.quantize_mxfp8(torch.randn(1536, 6144, device="cuda") * 0.02))
    x = torch.randn(W8A8_MIN_ROWS, 6144, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(envs, "MXFP8_W8A8", True)
    before = dispatch.executed[("packed_linear_w8a8", "triton")]
    out = packed_linear(x, m)
    assert dispatch.executed[("packed_linear_w8a8", "triton")] == before + 1
    assert _rel(out, rp.w8a8_reference(x, m.weight, m.weight_block_scale)) < 4e-3
