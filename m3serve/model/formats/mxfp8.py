"""MiniMax's MXFP8 checkpoints (`quant_method: "mxfp8"`): e4m3 `weight` and E8M0
`weight_scale_inv` (a multiplier despite its name) per 32 inputs, every linear but those in
`ignored_layers`. M3.1-Flash's mixed variant adds `moe_quant_algo: "NVFP4"` with
`moe_quant_format: "nvfp4-pack-quantized"`: its routed experts are compressed-tensors NVFP4."""
from __future__ import annotations


from m3serve.model.formats import QuantScheme, glob_match


def _list(qc: dict, key: str) -> list:
    value = qc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"quantization_config.{key}: expected a list of module names, got {value!r}")
    return value


def parse(qc: dict) -> QuantScheme:
    algo = qc.get("quant_algo")
    if algo is not None and str(algo).upper() != "MXFP8":
        raise ValueError(f"quantization_config.quant_algo: unsupported value {algo!r} with quant_method "
                         f"mxfp8 (supported: MXFP8)")
    block = qc.get("weight_block_size")
    if block is not None and list(block) != [1, 32]:
        raise ValueError(f"quantization_config.weight_block_size: unsupported value {block!r} (supported: [1, 32])")
    ignored = [*_list(qc, "ignored_layers"), *_list(qc, "exclude_modules"), *_list(qc, "ignore")]
    moe_algo, moe_format = qc.get("moe_quant_algo"), qc.get("moe_quant_format")
    experts = "mxfp8"
    if moe_algo is not None or moe_format is not None:
        if str(moe_algo).upper() != "NVFP4" or moe_format != "nvfp4-pack-quantized":
            raise ValueError(f"quantization_config.moe_quant_algo / moe_quant_format: unsupported values "
                             f"{moe_algo!r} / {moe_format!r} (supported: 'NVFP4' / 'nvfp4-pack-quantized')")
        experts = "ct-nvfp4"

    def rule(module: str):
        if glob_match(ignored, module):
            return None
        return experts if ".block_sparse_moe.experts." in module else "mxfp8"

    mixed = " with NVFP4 routed experts" if experts != "mxfp8" else ""
    return QuantScheme("mxfp8", rule, f"MXFP8{mixed}")


def config(ignored_layers: list[str], nvfp4_experts: bool = False) -> dict:
    """The quantization_config a fixture in this layout carries."""
    qc = {"quant_method": "mxfp8", "ignored_layers": list(ignored_layers)}
    if nvfp4_experts:
        qc.update(moe_quant_algo="NVFP4", moe_quant_format="nvfp4-pack-quantized")
    return qc


