"""The CPU path's sigmoids give a row the same result whatever rows share its call: the MoE
router's weights and experts, and SwiGLU-OAI's activation (torch's fp32 sigmoid alone does
not: its vector loop and scalar tail differ by an ulp, and where the tail falls depends on the
tensor's size, and on how it is split over threads)."""
import torch

from m3serve.layers.activation import swiglu_oai_ref
from m3serve.layers.moe import route


def test_route_row_alone_equals_row_in_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(367, 64, generator=g).to(torch.bfloat16)
    gate, bias = torch.randn(16, 64, generator=g) * 0.3, torch.randn(16, generator=g) * 0.01
    weights, ids = route(x, gate, bias, 4, 2.0)
    for t in range(x.shape[0]):
        w1, i1 = route(x[t:t + 1], gate, bias, 4, 2.0)
        assert torch.equal(w1, weights[t:t + 1]) and torch.equal(i1, ids[t:t + 1]), t


def test_swiglu_row_alone_equals_row_in_batch():
    """A width that no vector length divides puts each row's last elements in the scalar tail
    when the row is alone, and mostly in the vector loop inside the batch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(401, 2 * 100, generator=g) * 3
    batch = swiglu_oai_ref(x, 1.702, 7.0)
    differing = [t for t in range(x.shape[0]) if not torch.equal(swiglu_oai_ref(x[t:t + 1], 1.702, 7.0), batch[t:t + 1])]
    assert not differing, f"rows computed differently alone: {differing[:10]} ({len(differing)} of {x.shape[0]})"
