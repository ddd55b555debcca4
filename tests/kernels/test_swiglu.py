"""The one-pass SwiGLU-OAI kernel on a GPU at the dense MLP's width (12288), decode and prefill
row counts, against the PyTorch op."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("t", [1, 8, 4096])
def test_dense_mlp_width(t):
    from m3serve.kernels.swiglu import swiglu_oai_fused
    from m3serve.layers.activation import swiglu_oai_ref
    x = (torch.randn(t, 2 * 12288, device="cuda") * 4).bfloat16()
    torch.testing.assert_close(swiglu_oai_fused(x, 1.702, 7.0), swiglu_oai_ref(x, 1.702, 7.0),
                               atol=0, rtol=2 ** -7)
