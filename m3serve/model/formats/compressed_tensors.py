"""compressed-tensors NVFP4 (`quant_method: "compressed-tensors"`, format
`nvfp4-pack-quantized`): uint8 `weight_packed` (two E2M1, low nibble first), e4m3
`weight_scale` per 16 inputs, fp32 `weight_global_scale` that dequantisation divides by, and
fp32 `input_global_scale` (stored; unused here). Modules are chosen by each config group's
`targets` ("Linear", exact names or "re:" regexes) minus `ignore`."""
from __future__ import annotations

from m3serve.model.formats import QuantScheme, regex_or_name_match

FORMAT = "nvfp4-pack-quantized"


def _check_group(name: str, group: dict, top_format) -> list:
    where = f"quantization_config.config_groups.{name}"
    if not isinstance(group, dict):
        raise ValueError(f"{where}: expected an object")
    fmt = group.get("format", top_format)
    if fmt != FORMAT:
        raise ValueError(f"{where}.format: unsupported value {fmt!r} (supported: {FORMAT!r})")
    w = group.get("weights") or {}
    want = {"num_bits": 4, "type": "float", "group_size": 16}
    for key, value in want.items():
        if w.get(key) != value:
            raise ValueError(f"{where}.weights.{key}: unsupported value {w.get(key)!r} for {FORMAT} "
                             f"(supported: {value!r})")
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{where}.targets: expected a non-empty list")
    return targets


def parse(qc: dict) -> QuantScheme:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config.config_groups: expected a non-empty object")
    targets = [t for name, g in groups.items() for t in _check_group(name, g, qc.get("format"))]
    ignore = qc.get("ignore", [])
    if not isinstance(ignore, list):
        raise ValueError(f"quantization_config.ignore: expected a list, got {ignore!r}")

    def rule(module: str):
        if regex_or_name_match(ignore, module):
            return None
        if "Linear" in targets or regex_or_name_match(targets, module):
            return "ct-nvfp4"
        return None
    return QuantScheme("compressed-tensors", rule, "compressed-tensors NVFP4")


def config(ignore: list[str], targets: list[str] = ("Linear",)) -> dict:
    return {"quant_method": "compressed-tensors", "format": FORMAT,
            "config_groups": {"group_0": {
                "targets": list(targets), "format": FORMAT,
                "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                      "group_size": 16, "symmetric": True, "dynamic": "local"}}},
            "ignore": list(ignore)}
