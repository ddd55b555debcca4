"""Random weights generated in place on the model's device (`--load-format dummy`), scaled so
that activations stay finite and the router spreads tokens over experts like a trained model
(iid router rows, zero correction bias): benchmark numbers depend on how many distinct experts a
batch touches, so routing must be balanced, and the benchmark reports what it measured.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.zero_()
        elif p.dim() == 1:                                   # norm offsets (Gemma: 1 + w)
            p.normal_(0.0, 0.02, generator=gen)
        else:
            fan_in = p.shape[-1]
            p.normal_(0.0, 1.0 / fan_in ** 0.5, generator=gen)
