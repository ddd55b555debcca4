"""Quantised checkpoint formats: which linear of a checkpoint is stored how, read from its
config.json's `quantization_config` (no torch here: `m3serve plan` uses it too).

`detect_scheme(raw_config)` -> a `QuantScheme` (None for an unquantised checkpoint): the layout
name (`LAYOUT_FORMATS`) of every linear module by its canonical name
(`model.layers.3.self_attn.q_proj`, `model.layers.3.block_sparse_moe.experts.0.w1`), or None
where it stays in the model's dtype. One module per format family parses its own config keys:
mxfp8 (MiniMax's release and M3.1-Flash's mixed variant), modelopt, compressed_tensors, quark.
`layouts.py` holds each layout's tensors, the loader's renaming and the fixture writer.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from m3serve.model.config import M3Config, canonical_shapes

# layout name -> the packed format its weights hold (layouts.py has their tensors)
LAYOUT_FORMATS = {"mxfp8": "mxfp8", "modelopt-mxfp8": "mxfp8", "modelopt-nvfp4": "nvfp4",
                  "ct-nvfp4": "nvfp4", "quark-mxfp4": "mxfp4"}


@dataclass
class QuantScheme:
    """What a checkpoint's quantization_config says, per linear module."""
    method: str                                   # e.g. "mxfp8", "quark"
    rule: object                                  # callable(canonical module) -> layout name | None
    summary: str = ""
    _cache: dict = field(default_factory=dict, repr=False)

    def layout_of(self, module: str) -> str | None:
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


def module_names(canonical_module: str) -> tuple[str, ...]:
    """The spellings config lists may use for a module: canonical (`model.layers.3.mlp`), the
    original checkpoint's (`language_model.model.layers.3.mlp`) and transformers'
    (`model.language_model.layers.3.mlp`)."""
    names = (canonical_module, "language_model." + canonical_module)
    if canonical_module.startswith("model."):
        names += ("model.language_model." + canonical_module[len("model."):],)
    return names


def glob_match(patterns, module: str) -> bool:
    """Exact names, a parent module's name, or fnmatch patterns, against every spelling of
    the module name."""
    names = module_names(module)
    for p in patterns or ():
        for n in names:
            if n == p or fnmatch.fnmatchcase(n, p) or n.startswith(p + "."):
                return True
    return False


def regex_or_name_match(patterns, module: str) -> bool:
    """compressed-tensors targets / ignore entries: "re:<regex>" (full match) or an exact name,
    against every spelling of the module name."""
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


