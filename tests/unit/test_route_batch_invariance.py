"""The MoE router on CPU gives a row the same routing weights and experts whatever rows share
its call (torch's fp32 sigmoid alone is not: its vector loop and scalar tail differ by an ulp)."""
import torch

from m3serve.layers.moe import route


def test_route_row_alone_equals_row_in_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(367, 64, generator=g).to(torch.bfloat16)
    gate, bias = torch.randn(16, 64, generator=g) * 0.3, torch.randn(16, generator=g) * 0.01
    weights, ids = route(x, gate, bias, 4, 2.0)
    for t in range(x.shape[0]):
        w1, i1 = route(x[t:t + 1], gate, bias, 4, 2.0)
        assert torch.equal(w1, weights[t:t + 1]) and torch.equal(i1, ids[t:t + 1]), t
