"""Online FP8 quantisation of a loaded model (`--quantization fp8`): every linear layer and the
routed experts in place, with the per-output-row scales `layers/quant.py` multiplies by.
Embeddings, lm_head, the router and the norms stay as loaded."""
from __future__ import annotations

import torch
from torch import nn

from m3serve.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                   RowParallelLinear)
from m3serve.layers.moe import Experts
from m3serve.layers.quant import quantize_linear_, quantize_weight


def quantize_model_fp8(model: nn.Module) -> int:
    """Quantise every linear layer and the routed experts in place; returns the module count."""
    count = 0
    for _, module in model.named_modules():
        if isinstance(module, (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                               RowParallelLinear)):
            quantize_linear_(module)
            count += 1
        elif isinstance(module, Experts):
            for name in ("w13", "w2"):
                wq, scale = quantize_weight(getattr(module, name).data)
                setattr(module, name, nn.Parameter(wq, requires_grad=False))
                setattr(module, name + "_scale", scale)
            count += 1
    if model.lm_head.weight.is_cuda:
        torch.cuda.empty_cache()
    return count
