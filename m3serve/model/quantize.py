"""Online FP8 quantisation while loading (`--quantization fp8`): every linear layer's weight
and the routed experts' stacks, in place, with the per-output-row scales `layers/quant.py`
multiplies by. Embeddings, lm_head, the router and the norms stay as loaded."""
from __future__ import annotations

from torch import nn

from m3serve.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                   RowParallelLinear)
from m3serve.layers.moe import Experts
from m3serve.layers.quant import quantize_linear_, quantize_weight


_LINEARS = (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear)


def quantize_param_fp8(model: nn.Module, name: str) -> bool:
    """Quantise parameter `name` of `model` in place if online FP8 covers it (a linear layer's
    weight, an expert stack's w13 / w2); returns whether it did. Called by the loader as each
    weight completes, so only the weights in flight are ever held in bf16."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if isinstance(owner, _LINEARS) and attr == "weight":
        quantize_linear_(owner)
    elif isinstance(owner, Experts) and attr in ("w13", "w2"):
        wq, scale = quantize_weight(getattr(owner, attr).data)
        setattr(owner, attr, nn.Parameter(wq, requires_grad=False))
        setattr(owner, attr + "_scale", scale)
    else:
        return False
    return True
