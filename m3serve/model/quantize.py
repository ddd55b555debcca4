"""Online quantisation while loading, each weight as soon as its last shard arrives.
`--quantization fp8`: every linear layer's weight and the routed experts' stacks, with the
per-output-row scales `layers/quant.py` multiplies by. `--quantization mxfp4 | nvfp4`: the
routed and shared experts only, into packed codes (`layers/packed.py`; NVFP4 with one global
scale per output row). `--quantization mxfp8`: every linear layer and the routed experts into
MXFP8 codes, the modules the MXFP8 release quantises. Embeddings, lm_head, the router and the
norms stay as loaded."""
from __future__ import annotations

import torch
from torch import nn

from m3serve.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                   RowParallelLinear)
from m3serve.layers.moe import Experts
from m3serve.layers.packed import MXFP4, MXFP8, NVFP4, PackedFormat, check_blocks, set_packed_, split_note
from m3serve.layers.quant import quantize_linear_, quantize_weight

ONLINE_PACKED = {"mxfp4": MXFP4, "nvfp4": NVFP4, "mxfp8": MXFP8}
_CHUNK_ELEMS = 1 << 26          # fp32 temporaries of a few hundred MiB at most while quantising


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


def quantize_packed(w: torch.Tensor, fmt: PackedFormat):
    """[..., N, K] -> (codes, block scales, global scales [..., N] or None) in an online format
    (mxfp4, nvfp4 or mxfp8), rows quantised independently in chunks (NVFP4: each row's global
    scale from its own amax)."""
    from m3serve.kernels.ref.packed import (nvfp4_global_scale, quantize_mxfp4, quantize_mxfp8,
                                            quantize_nvfp4)
    rows = w.reshape(-1, w.shape[-1])
    n, k = rows.shape
    codes = torch.empty((n, k // fmt.per_byte), dtype=fmt.code_dtype, device=w.device)
    scales = torch.empty((n, k // fmt.block), dtype=fmt.scale_dtype, device=w.device)
    glob = torch.empty(n, dtype=torch.float32, device=w.device) if fmt.has_global else None
    step = max(1, _CHUNK_ELEMS // max(1, k))
    for i in range(0, n, step):
        part = rows[i:i + step]
        if fmt.kind == "nvfp4":
            glob[i:i + step] = nvfp4_global_scale(part.float().abs().amax(-1))
            codes[i:i + step], scales[i:i + step] = quantize_nvfp4(part, glob[i:i + step])
        elif fmt.kind == "mxfp8":
            codes[i:i + step], scales[i:i + step] = quantize_mxfp8(part)
        else:
            codes[i:i + step], scales[i:i + step] = quantize_mxfp4(part)
    lead = w.shape[:-1]
    return (codes.view(*lead, -1), scales.view(*lead, -1), None if glob is None else glob.view(lead))


def quantize_param_packed(model: nn.Module, name: str, fmt: PackedFormat) -> bool:
    """Quantise parameter `name` of `model` to `fmt` in place if it is a routed expert stack
    (w13 / w2) or a shared expert's weight, or for MXFP8 any linear layer's weight; returns
    whether it did. This rank's shard is quantised as it is, so its K must hold whole scale
    blocks."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    experts = isinstance(owner, Experts) and attr in ("w13", "w2")
    shared = ".shared_experts." in name and attr == "weight" and isinstance(
        owner, (MergedColumnParallelLinear, RowParallelLinear))
    linear = fmt.kind == "mxfp8" and attr == "weight" and isinstance(owner, _LINEARS)
    if not (experts or shared or linear):
        return False
    w = getattr(owner, attr).data
    check_blocks(w.shape[-1], fmt, name, split_note(owner, attr))
    set_packed_(owner, attr, fmt, *quantize_packed(w, fmt))
    return True
