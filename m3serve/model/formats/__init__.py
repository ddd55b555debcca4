"""Quantised checkpoint formats: which linear of a checkpoint is stored how, read from its
config.json's `quantization_config`, and the tensors that holds per linear.

`detect_scheme(raw_config)` -> a `QuantScheme` (None for an unquantised checkpoint): the
`TensorLayout` of every linear module by its canonical name (`model.layers.3.self_attn.q_proj`,
`model.layers.3.block_sparse_moe.experts.0.w1`), or None where it stays in the model's dtype.
One module per format family parses its own config keys and writes fixtures in its layout:
  mxfp8 (MiniMax's release and M3.1-Flash's mixed variant), modelopt, compressed_tensors, quark.
Canonical names of a packed linear `M`: `M.weight` (codes), `M.weight_block_scale`,
`M.weight_global_scale` (NVFP4) and `M.<name>` for stored activation scales, which are checked
and not used (activations stay in the model's dtype, docs/model.md).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import torch

from m3serve.layers.packed import PackedFormat
from m3serve.model.config import M3Config, canonical_shapes

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


def _code_dtypes(fmt: PackedFormat) -> tuple:
    return (fmt.code_dtype,)


@dataclass
class QuantScheme:
    """What a checkpoint's quantization_config says, per linear module."""
    method: str                                   # e.g. "mxfp8", "quark"
    rule: object                                  # callable(canonical module) -> TensorLayout | None
    summary: str = ""
    _cache: dict = field(default_factory=dict, repr=False)

    def layout_of(self, module: str) -> TensorLayout | None:
        """The layout of a canonical module; None for unquantised ones and for anything that
        is not a decoder layer's linear (norms, router, embedding, lm_head)."""
        if module not in self._cache:
            linear = module.startswith("model.layers.") and module.rpartition(".")[2] in _LINEARS \
                and ".block_sparse_moe.gate" not in module
            self._cache[module] = self.rule(module) if linear else None
        return self._cache[module]


_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "index_q_proj", "index_k_proj", "gate_proj", "up_proj",
            "down_proj", "w1", "w2", "w3")


SUPPORTED_METHODS = ("mxfp8", "modelopt", "compressed-tensors", "quark")


def detect_scheme(raw: dict) -> QuantScheme | None:
    """The checkpoint's quantisation scheme from its config.json dict (None: not quantised).
    Unknown methods or settings raise a ValueError naming the key and what is supported."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config: expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    method_l = str(method).lower()
    if method_l == "mxfp8":
        from m3serve.model.formats.mxfp8 import parse
    elif method_l == "modelopt":
        from m3serve.model.formats.modelopt import parse
    elif method_l == "compressed-tensors":
        from m3serve.model.formats.compressed_tensors import parse
    elif method_l == "quark":
        from m3serve.model.formats.quark import parse
    else:
        raise ValueError(f"quantization_config.quant_method: unsupported value {method!r} "
                         f"(supported: {', '.join(SUPPORTED_METHODS)})")
    return parse(qc)


def module_names(canonical_module: str) -> tuple[str, str]:
    """(canonical, original checkpoint) names of a module, which config lists may use."""
    if canonical_module.startswith("model."):
        return canonical_module, "language_model." + canonical_module
    return canonical_module, "language_model." + canonical_module


def glob_match(patterns, module: str) -> bool:
    """fnmatch patterns (or exact names, or a name's prefix ending in '.') against either
    spelling of the module name."""
    names = module_names(module)
    for p in patterns or ():
        for n in names:
            if n == p or fnmatch.fnmatchcase(n, p) or n.startswith(p + "."):
                return True
    return False


def regex_or_name_match(patterns, module: str) -> bool:
    """compressed-tensors targets / ignore entries: "re:<regex>" (full match) or an exact name,
    against either spelling."""
    names = module_names(module)
    for p in patterns or ():
        for n in names:
            if p.startswith("re:") and re.fullmatch(p[3:], n) or n == p:
                return True
    return False


def quantizable_modules(cfg: M3Config) -> list[str]:
    """The canonical linear modules a quantisation config may cover (never the embedding,
    lm_head, router or norms)."""
    out = []
    for name, shape in canonical_shapes(cfg).items():
        if len(shape) != 2 or not name.endswith(".weight") or not name.startswith("model.layers."):
            continue
        if name.endswith("block_sparse_moe.gate.weight"):
            continue
        out.append(name[:-len(".weight")])
    return out


def expected_tensors(cfg: M3Config, scheme: QuantScheme | None):
    """(shapes, dtypes) of every canonical tensor the checkpoint must hold: `shapes` name ->
    full shape, `dtypes` name -> accepted dtypes (only for packed tensors; others are cast)."""
    shapes = dict(canonical_shapes(cfg))
    dtypes: dict[str, tuple] = {}
    if scheme is None:
        return shapes, dtypes
    for mod in quantizable_modules(cfg):
        layout = scheme.layout_of(mod)
        if layout is None:
            continue
        fmt = layout.fmt
        n, k = shapes[mod + ".weight"]
        if k % fmt.block:
            raise ValueError(f"{mod}: input width {k} is not a multiple of the {fmt.name} block {fmt.block}")
        shapes[mod + ".weight"] = (n, k // fmt.per_byte)
        dtypes[mod + ".weight"] = _code_dtypes(fmt)
        shapes[mod + ".weight_block_scale"] = (n, k // fmt.block)
        dtypes[mod + ".weight_block_scale"] = layout.block_scale_dtypes
        if layout.global_scale:
            shapes[mod + ".weight_global_scale"] = (1,)
            dtypes[mod + ".weight_global_scale"] = (torch.float32,)
        for s in layout.act_scales:
            shapes[f"{mod}.{s}"] = (1,)
            dtypes[f"{mod}.{s}"] = (torch.float32,)
    return shapes, dtypes


def canonical_module(key: str) -> str | None:
    """The canonical module name of a checkpoint tensor in the original naming (its last
    component dropped), or None for tensors outside the text model's layers."""
    from m3serve.model.loader import canonicalize
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
    layout = scheme.layout_of(mod) if mod.startswith("model.layers.") else None
    if layout is None:
        return None
    suffix = key.rpartition(".")[2]
    canon = layout.suffixes().get(suffix)
    if canon is None:
        return f"{mod}.{suffix}", False                  # reported as unexpected
    return f"{mod}.{canon}", canon not in ("weight", "weight_block_scale")


def checkpoint_name(scheme: QuantScheme | None, canonical: str) -> str:
    """How a canonical tensor name is spelled in the checkpoint (for messages): a packed
    linear's parts under the format's own suffixes; other names as they are."""
    module, _, part = canonical.rpartition(".")
    layout = scheme.layout_of(module) if scheme is not None else None
    if layout is None:
        return canonical
    back = {v: k for k, v in layout.suffixes().items()}
    return f"language_model.{module}.{back.get(part, part)}"


def quantize_for_layout(layout: TensorLayout, w: torch.Tensor, amax: torch.Tensor | None = None) -> dict:
    """One linear's bf16/fp32 weight [N, K] -> its checkpoint tensors {suffix: tensor}, by our
    own implementation of the format's published rules (fixtures, `m3serve make-tiny`).
    `amax`: the NVFP4 global scale's tensor amax (a fused group's shared maximum; default w's)."""
    from m3serve.kernels.ref.packed import (E2M1_MAX, E4M3_MAX, nvfp4_global_scale, quantize_mxfp4,
                                            quantize_mxfp8, quantize_nvfp4)
    kind, w = layout.fmt.kind, w.float()
    if kind == "mxfp8":
        q, s = quantize_mxfp8(w)
        return {layout.codes: q, layout.block_scale: s}
    if kind == "mxfp4":
        q, s = quantize_mxfp4(w)
        return {layout.codes: q, layout.block_scale: s}
    amax = w.abs().amax() if amax is None else amax.float()
    if layout.fmt.global_divides:                       # compressed-tensors: [1] tensors
        g = nvfp4_global_scale(amax).reshape(1)
        q, s = quantize_nvfp4(w, g)
        out = {layout.codes: q, layout.block_scale: s, layout.global_scale: g}
        out.update({a: torch.ones(1) for a in layout.act_scales})
        return out
    scale_2 = (amax / (E4M3_MAX * E2M1_MAX)).reshape(())      # ModelOpt: 0-d, multiplies
    q, s = quantize_nvfp4(w, 1.0 / scale_2)
    out = {layout.codes: q, layout.block_scale: s, layout.global_scale: scale_2}
    out.update({a: torch.ones(()) for a in layout.act_scales})
    return out


def dequantized_checkpoint(model_dir) -> dict[str, torch.Tensor]:
    """Every text-model tensor of a checkpoint in canonical names, packed linears dequantised
    to fp32 by their format's rule (the weights the dense reference runs on)."""
    from m3serve.kernels.ref.packed import dequantize
    from m3serve.model.config import read_config_json
    from m3serve.model.loader import canonicalize, iter_checkpoint, materialize, weight_files
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
        fmt = scheme.layout_of(module).fmt
        g = p.get("weight_global_scale")
        n = p["weight"].shape[0]
        out[module + ".weight"] = dequantize(fmt.kind, p["weight"], p["weight_block_scale"],
                                             None if g is None else g.reshape(()).expand(n),
                                             fmt.global_divides)
    return out
