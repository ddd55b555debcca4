"""The tensors of each quantised checkpoint layout, and what the loader, the fixture writer and
the tests do with them: canonical names for a packed linear `M` are `M.weight` (codes),
`M.weight_block_scale`, `M.weight_global_scale` (NVFP4) and `M.<name>` for stored activation
scales, which are checked and not used (activations stay in the model's dtype, docs/model.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.layers.packed import MXFP4, MXFP8, NVFP4, NVFP4_MODELOPT, PackedFormat
from m3serve.model.config import M3Config, canonical_shapes
from m3serve.model.formats import QuantScheme, detect_scheme, quantizable_modules

E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


@dataclass(frozen=True)
class TensorLayout:
    """One quantised linear's tensors in a checkpoint (suffixes after the module name)."""
    fmt: PackedFormat
    codes: str                        # "weight" | "weight_packed"
    block_scale: str                  # "weight_scale_inv" | "weight_scale"
    block_scale_dtypes: tuple         # accepted dtypes of the block scales
    global_scale: str | None = None   # "weight_global_scale" (divides) | "weight_scale_2" (multiplies)
    act_scales: tuple[str, ...] = ()  # stored activation scales: present, one value, unused

    def suffixes(self) -> dict[str, str]:
        """checkpoint suffix -> canonical suffix."""
        out = {self.codes: "weight", self.block_scale: "weight_block_scale"}
        if self.global_scale:
            out[self.global_scale] = "weight_global_scale"
        out.update({s: s for s in self.act_scales})
        return out


LAYOUTS = {
    # MiniMax's MXFP8 release: the scale is named _inv but multiplies
    "mxfp8": TensorLayout(MXFP8, "weight", "weight_scale_inv", E8M0_DTYPES),
    "modelopt-mxfp8": TensorLayout(MXFP8, "weight", "weight_scale", E8M0_DTYPES),
    "modelopt-nvfp4": TensorLayout(NVFP4_MODELOPT, "weight", "weight_scale", (torch.float8_e4m3fn,),
                                   "weight_scale_2", ("input_scale",)),
    "ct-nvfp4": TensorLayout(NVFP4, "weight_packed", "weight_scale", (torch.float8_e4m3fn,),
                             "weight_global_scale", ("input_global_scale",)),
    "quark-mxfp4": TensorLayout(MXFP4, "weight", "weight_scale", E8M0_DTYPES),
}


def layout(scheme: QuantScheme | None, module: str) -> TensorLayout | None:
    """The tensors a canonical module is stored as under `scheme` (None: unquantised)."""
    name = scheme.layout_of(module) if scheme is not None else None
    return None if name is None else LAYOUTS[name]


def packed_format_of(scheme: QuantScheme, module: str) -> PackedFormat | None:
    lay = layout(scheme, module)
    return None if lay is None else lay.fmt


def expected_tensors(cfg: M3Config, scheme: QuantScheme | None):
    """(shapes, dtypes) of every canonical tensor the checkpoint must hold: `shapes` name ->
    full shape, `dtypes` name -> accepted dtypes (only for packed tensors; others are cast)."""
    shapes = dict(canonical_shapes(cfg))
    dtypes: dict[str, tuple] = {}
    if scheme is None:
        return shapes, dtypes
    for mod in quantizable_modules(cfg):
        lay = layout(scheme, mod)
        if lay is None:
            continue
        fmt = lay.fmt
        n, k = shapes[mod + ".weight"]
        if k % fmt.block:
            raise ValueError(f"{mod}: input width {k} is not a multiple of the {fmt.name} block {fmt.block}")
        shapes[mod + ".weight"] = (n, k // fmt.per_byte)
        dtypes[mod + ".weight"] = (fmt.code_dtype,)
        shapes[mod + ".weight_block_scale"] = (n, k // fmt.block)
        dtypes[mod + ".weight_block_scale"] = lay.block_scale_dtypes
        if lay.global_scale:
            shapes[mod + ".weight_global_scale"] = (1,)
            dtypes[mod + ".weight_global_scale"] = (torch.float32,)
        for s in lay.act_scales:
            shapes[f"{mod}.{s}"] = (1,)
            dtypes[f"{mod}.{s}"] = (torch.float32,)
    return shapes, dtypes


def canonical_module(key: str) -> str | None:
    """The canonical module name of a checkpoint tensor in the original naming (its last
    component dropped), or None for tensors outside the text model's layers."""
    from m3serve.model.checkpoint import canonicalize
    module, _, _ = key.rpartition(".")
    try:
        pairs = canonicalize(module + ".weight", None)
    except (AttributeError, TypeError):     # a fused transformers-named tensor: not a packed layout
        return None
    if not pairs or len(pairs) != 1:
        return None
    name = pairs[0][0]
    return name[:-len(".weight")] if name.endswith(".weight") else None


def rename(scheme: QuantScheme, key: str) -> tuple[str, bool] | None:
    """A packed module's checkpoint tensor -> (canonical name, is_scalar); None when `key`
    is not a tensor of a module the scheme quantises (it goes through the plain naming)."""
    mod = canonical_module(key)
    if mod is None:
        return None
    lay = layout(scheme, mod)
    if lay is None:
        return None
    suffix = key.rpartition(".")[2]
    canon = lay.suffixes().get(suffix)
    if canon is None:
        return f"{mod}.{suffix}", False                  # reported as unexpected
    return f"{mod}.{canon}", canon not in ("weight", "weight_block_scale")


def checkpoint_name(scheme: QuantScheme | None, canonical: str) -> str:
    """How a canonical tensor name is spelled in the checkpoint (for messages): a packed
    linear's parts under the format's own suffixes; other names as they are."""
    module, _, part = canonical.rpartition(".")
    lay = layout(scheme, module)
    if lay is None:
        return canonical
    back = {v: k for k, v in lay.suffixes().items()}
    return f"language_model.{module}.{back.get(part, part)}"


def quantize_for_layout(lay: TensorLayout, w: torch.Tensor, amax: torch.Tensor | None = None) -> dict:
    """One linear's bf16/fp32 weight [N, K] -> its checkpoint tensors {suffix: tensor}, by our
    own implementation of the format's published rules (fixtures, `m3serve make-tiny`).
    `amax`: the NVFP4 global scale's tensor amax (a fused group's shared maximum; default w's)."""
    from m3serve.kernels.ref.packed import (E2M1_MAX, E4M3_MAX, nvfp4_global_scale, quantize_mxfp4,
                                            quantize_mxfp8, quantize_nvfp4)
    kind, w = lay.fmt.kind, w.float()
    if kind == "mxfp8":
        q, s = quantize_mxfp8(w)
        return {lay.codes: q, lay.block_scale: s}
    if kind == "mxfp4":
        q, s = quantize_mxfp4(w)
        return {lay.codes: q, lay.block_scale: s}
    amax = w.abs().amax() if amax is None else amax.float()
    if lay.global_scale == "weight_global_scale":     # compressed-tensors: [1] tensors, divides
        g = nvfp4_global_scale(amax).reshape(1)
        q, s = quantize_nvfp4(w, g)
        out = {lay.codes: q, lay.block_scale: s, lay.global_scale: g}
        out.update({a: torch.ones(1) for a in lay.act_scales})
        return out
    scale_2 = (amax / (E4M3_MAX * E2M1_MAX)).reshape(())      # ModelOpt: 0-d, multiplies
    q, s = quantize_nvfp4(w, 1.0 / scale_2)
    out = {lay.codes: q, lay.block_scale: s, lay.global_scale: scale_2}
    out.update({a: torch.ones(()) for a in lay.act_scales})
    return out


def dequantized_checkpoint(model_dir) -> dict[str, torch.Tensor]:
    """Every text-model tensor of a checkpoint in canonical names, packed linears dequantised
    to fp32 by their format's rule (the weights the dense reference runs on)."""
    from m3serve.kernels.ref.packed import dequantize
    from m3serve.model.config import read_config_json
    from m3serve.model.checkpoint import canonicalize, iter_checkpoint, materialize, weight_files
    from pathlib import Path
    model_dir = Path(model_dir)
    scheme = detect_scheme(read_config_json(model_dir))
    out, parts = {}, {}
    for _, key, t in iter_checkpoint(weight_files(model_dir)):
        packed = rename(scheme, key) if scheme is not None else None
        if packed is not None:
            module, _, part = packed[0].rpartition(".")
            parts.setdefault(module, {})[part] = materialize(t)
            continue
        for name, tensor in canonicalize(key, t) or []:
            out[name] = materialize(tensor).float()
    for module, p in parts.items():
        fmt = layout(scheme, module).fmt
        g = p.get("weight_global_scale")
        n = p["weight"].shape[0]
        out[module + ".weight"] = dequantize(fmt.kind, p["weight"], p["weight_block_scale"],
                                             None if g is None else g.reshape(()).expand(n),
                                             fmt.global_divides)
    return out
