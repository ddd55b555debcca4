"""CPU interpreter tests of the Triton RMSNorm kernels at tiny shapes, and the reference against
the layer op (gemma_rms_norm after a bf16 residual add)."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels.ref.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref  # noqa: E402
from m3serve.kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from m3serve.layers.norm import gemma_rms_norm  # noqa: E402
from test_rmsnorm import make_rows  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ref_matches_layer_ops(dtype):
    x, res, w = make_rows(5, 96, dtype, "cpu")
    out, new_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(new_res, x + res)
    assert torch.equal(out, gemma_rms_norm(x + res, w, 1e-6))
    assert torch.equal(rms_norm_ref(x, w, 1e-6), gemma_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_ref(dtype):
    x, res, w = make_rows(6, 80, dtype, "cpu")   # N not a power of two: masked tail
    x = torch.cat([x, x], dim=-1)[:, :80]         # strided rows
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    plain, ref_plain = rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    if dtype == torch.bfloat16:  # bit-exact in the real dtype
        assert torch.equal(out, ref_out) and torch.equal(plain, ref_plain)
    else:  # fp32: only the reduction order differs
        torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(plain, ref_plain, atol=1e-6, rtol=1e-6)
    assert out.shape == x.shape and not torch.equal(out, plain)


def test_3d_input_and_bad_weight():
    x, res, w = make_rows(6, 32, torch.bfloat16, "cpu")
    out = rms_norm(x.view(2, 3, 32), w, 1e-6)
    assert torch.equal(out.view(6, 32), rms_norm_ref(x, w, 1e-6))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:16], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, res[:3], w, 1e-6)
