"""CPU interpreter test of the one-pass SwiGLU-OAI kernel against the PyTorch op it replaces,
values past both clamps included."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels.swiglu import swiglu_oai_fused  # noqa: E402
from m3serve.layers.activation import swiglu_oai_ref  # noqa: E402


@pytest.mark.parametrize("t,inter", [(1, 8), (3, 100), (5, 2500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(t, inter, dtype):
    g = torch.Generator().manual_seed(t * inter)
    x = (torch.randn(t, 2 * inter, generator=g) * 5).to(dtype)       # +-limit (7) crossed often
    got = swiglu_oai_fused(x, 1.702, 7.0)
    ref = swiglu_oai_ref(x, 1.702, 7.0)
    assert got.dtype == dtype and got.shape == (t, inter)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(got, ref, **tol)


def test_strided_rows_and_bad_width():
    x = torch.randn(4, 64)[:, :32]
    torch.testing.assert_close(swiglu_oai_fused(x, 1.702, 7.0), swiglu_oai_ref(x, 1.702, 7.0))
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        swiglu_oai_fused(torch.randn(2, 7), 1.702, 7.0)
