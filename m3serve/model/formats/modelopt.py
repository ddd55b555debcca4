"""NVIDIA ModelOpt checkpoints (`quant_method: "modelopt"`): `quant_algo` MXFP8, NVFP4 or
MIXED_PRECISION (per-module algorithms in `quantized_layers`, e.g. NVFP4 experts over an MXFP8
base; modules not listed stay unquantised), `exclude_modules` / `ignore` honoured.
NVFP4: uint8 `weight` (two E2M1, low nibble first), e4m3 `weight_scale` per 16 inputs,
fp32 `weight_scale_2` that multiplies, fp32 `input_scale` (stored; unused here).
MXFP8: e4m3 `weight`, E8M0 `weight_scale` per 32 inputs."""
from __future__ import annotations

from m3serve.model.formats import QuantScheme, glob_match, module_names

ALGOS = {"NVFP4": "modelopt-nvfp4", "MXFP8": "modelopt-mxfp8"}
_BLOCK = {"NVFP4": 16, "MXFP8": 32}


def _algo(recipe, where: str) -> str:
    algo = str((recipe or {}).get("quant_algo", "")).upper() if isinstance(recipe, dict) else recipe
    if algo not in ALGOS:
        raise ValueError(f"quantization_config.{where}: unsupported quant_algo {algo!r} "
                         f"(supported: {', '.join(ALGOS)}, MIXED_PRECISION)")
    group = recipe.get("group_size") if isinstance(recipe, dict) else None
    want = _BLOCK[algo]
    if group is not None and int(group) != want:
        raise ValueError(f"quantization_config.{where}.group_size: unsupported value {group!r} for {algo} "
                         f"(supported: {want})")
    return ALGOS[algo]


def parse(qc: dict) -> QuantScheme:
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo", "")).upper()
    exclude = inner.get("exclude_modules", inner.get("ignore", qc.get("ignore", [])))
    if not isinstance(exclude, list):
        raise ValueError(f"quantization_config.exclude_modules: expected a list, got {exclude!r}")
    if algo == "MIXED_PRECISION":
        layers = inner.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise ValueError("quantization_config.quantized_layers: MIXED_PRECISION needs a non-empty "
                             "mapping of module name -> {quant_algo}")
        table = {name: _algo(r, f"quantized_layers[{name!r}]") for name, r in layers.items()}

        def rule(module: str):
            if glob_match(exclude, module):
                return None
            for n in module_names(module):
                if n in table:
                    return table[n]
            return None
        return QuantScheme("modelopt", rule, "ModelOpt mixed precision (" +
                           ", ".join(sorted(set(table.values()))) + ")")
    layout = _algo({"quant_algo": algo, "group_size": inner.get("group_size")}, "quant_algo")
    return QuantScheme("modelopt", lambda m: None if glob_match(exclude, m) else layout,
                       f"ModelOpt {algo}")


def config(quantized_layers: dict[str, str], exclude_modules: list[str]) -> dict:
    """A MIXED_PRECISION quantization_config: module name -> "NVFP4" | "MXFP8"."""
    return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
            "exclude_modules": list(exclude_modules),
            "quantized_layers": {name: ({"quant_algo": a, "group_size": 16} if a == "NVFP4" else {"quant_algo": a})
                                 for name, a in quantized_layers.items()}}
