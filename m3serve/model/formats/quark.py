"""AMD Quark MXFP4 (`quant_method: "quark"`): uint8 `weight` (two E2M1, element 2k in the low
nibble) and E8M0 `weight_scale` per 32 inputs, for every linear not matched by `exclude`
(fnmatch patterns). The weight spec in `global_quant_config` (and any `layer_quant_config`
entry) must be fp4 / per_group / 32 / e8m0."""
from __future__ import annotations

from m3serve.model.formats import QuantScheme, glob_match
WEIGHT_SPEC = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}


def _check(spec, where: str) -> None:
    w = (spec or {}).get("weight") if isinstance(spec, dict) else None
    if isinstance(w, list) and len(w) == 1:
        w = w[0]
    if not isinstance(w, dict):
        raise ValueError(f"quantization_config.{where}.weight: expected an object")
    for key, value in WEIGHT_SPEC.items():
        if w.get(key) != value:
            raise ValueError(f"quantization_config.{where}.weight.{key}: unsupported value {w.get(key)!r} "
                             f"(supported: {value!r}, MXFP4)")


def parse(qc: dict) -> QuantScheme:
    _check(qc.get("global_quant_config"), "global_quant_config")
    for name, spec in (qc.get("layer_quant_config") or {}).items():
        _check(spec, f"layer_quant_config[{name!r}]")
    exclude = qc.get("exclude", [])
    if not isinstance(exclude, list):
        raise ValueError(f"quantization_config.exclude: expected a list, got {exclude!r}")
    return QuantScheme("quark", lambda m: None if glob_match(exclude, m) else "quark-mxfp4", "Quark MXFP4")


# the release's exclude list: only the routed and shared experts are MXFP4
RELEASE_EXCLUDE = ["*lm_head", "*vision_tower*", "*multi_modal_projector*", "*patch_merge_mlp*",
                   "*block_sparse_moe.gate", "*self_attn*", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj"]


def config(exclude: list[str] = tuple(RELEASE_EXCLUDE)) -> dict:
    spec = dict(WEIGHT_SPEC, is_dynamic=False)
    return {"quant_method": "quark",
            "global_quant_config": {"weight": spec, "input_tensors": dict(WEIGHT_SPEC, is_dynamic=True),
                                    "output_tensors": None, "bias": None},
            "layer_quant_config": {}, "exclude": list(exclude)}
