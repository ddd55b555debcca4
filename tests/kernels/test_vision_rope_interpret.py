"""CPU interpreter tests of the vision encoder's split + 3-D RoPE kernel at tiny shapes: equal,
bit for bit, to the encoder's own ops (the qkv split and `layers.rotary.apply_rotary`), in bf16
and fp32, with strided rows and channels past the rotary part; bad shapes refused."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels.vision_rope import vision_qkv_rope  # noqa: E402
from m3serve.layers.rotary import apply_rotary  # noqa: E402


def reference(qkv, cos, sin, heads):
    n = qkv.shape[0]
    parts = qkv.reshape(n, 3, heads, -1)
    return apply_rotary(parts[:, 0], cos, sin), apply_rotary(parts[:, 1], cos, sin), parts[:, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,head_dim,half", [(4, 20, 9), (3, 16, 8), (2, 12, 3)])
def test_equals_the_encoder_ops(dtype, heads, head_dim, half):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    n = 7
    wide = torch.randn(n, 3 * heads * head_dim + 5, generator=gen).to(dtype)
    qkv = wide[:, :3 * heads * head_dim]                     # strided rows, as a view would be
    angles = torch.randn(n, half, generator=gen) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = vision_qkv_rope(qkv, cos, sin, heads)
    want = reference(qkv, cos, sin, heads)
    for g, w in zip(got, want):
        assert g.is_contiguous() and g.shape == (n, heads, head_dim)
        assert torch.equal(g, w)
    assert not torch.equal(got[0], qkv.reshape(n, 3, heads, -1)[:, 0])    # really rotated


def test_bad_shapes_refused():
    qkv = torch.zeros(4, 3 * 2 * 8)
    with pytest.raises(ValueError, match="rotary half"):
        vision_qkv_rope(qkv, torch.zeros(4, 5), torch.zeros(4, 5), heads=2)
    with pytest.raises(ValueError, match="3 x 5 heads"):
        vision_qkv_rope(qkv, torch.zeros(4, 2), torch.zeros(4, 2), heads=5)


def test_compiles_for_hopper(tmp_path):
    """The encoder's real shape (16 heads of 80, 13 x 3 rotary frequencies), bf16, for sm_90."""
    from test_rmsnorm import compile_for_hopper
    ptrs = {p: "*bf16" for p in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr", "v_ptr")}
    jobs = [("m3serve.kernels.vision_rope", "_vision_qkv_rope_kernel", ptrs,
             {"HEADS": 16, "D": 80, "HALF": 39, "BLOCK_H": 16, "BLOCK_D": 128, "EMULATE": False}, 4)]
    assert len(compile_for_hopper(jobs, tmp_path)) == 1
