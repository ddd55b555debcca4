"""The embedded tiny MiniMax-M3: a small random checkpoint in the real format, written
deterministically (config.json in the checkpoint's VL layout with legacy sparse names,
model.safetensors in the original tensor naming, a real byte-level BPE tokenizer and chat template).

Block size 16 with top-4 blocks, so prompts of a few hundred tokens exercise block selection.
Flavors (model/flavor.py): "m3" mixes dense and MSA attention layers; "m3.1-flash" is MSA in every
layer, in MiniMax-M3.1's config layout (no MTP keys, the sparse init block written out as 1, the
value reported for M3.1). The weights are written in bf16, or with `quantization` in a quantised
checkpoint layout (`QUANTIZED`), with wider MLPs (128) so that every scale block of 32 stays
inside one rank at TP 2 and 4.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from m3serve.model.config import canonical_shapes, parse_config
from m3serve.model.flavor import FLAVORS, M31_FLASH

TINY_VOCAB = 2048


def tiny_config_dict(vocab_size: int = TINY_VOCAB, bos_token_id: int | None = None,
                     eos_token_id: int | None = None, flavor: str = "m3") -> dict:
    """config.json of the tiny model: 5 layers, dense MLPs in the first two and MoE after;
    attention dense/MSA mixed ("m3") or MSA in every layer ("m3.1-flash")."""
    if flavor not in FLAVORS:
        raise ValueError(f"flavor {flavor!r} is not one of {list(FLAVORS)}")
    text = {
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "model_type": "minimax_m3_vl_text",
        "hidden_size": 64, "intermediate_size": 32, "dense_intermediate_size": 96,
        "shared_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": vocab_size,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "use_gemma_norm": True,
        "attention_output_gate": False, "use_qk_norm": True, "qk_norm_type": "per_head",
        "rope_theta": 5000000, "rotary_dim": 16, "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
        "hidden_act": "swigluoai", "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        "num_local_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "scoring_func": "sigmoid", "use_routing_bias": True, "routed_scaling_factor": 2.0,
        "moe_layer_freq": [0, 0, 1, 1, 1],
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_num_index_heads": 2, "sparse_index_dim": 32,
            "sparse_block_size": 16, "sparse_topk_blocks": 4, "sparse_local_block": 1,
            "sparse_init_block": 0, "sparse_score_type": "max",
            "sparse_attention_freq": [0, 1, 1, 1, 0], "sparse_disable_index_value": [0, 1, 1, 1, 0]},
        "tie_word_embeddings": False,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }
    if flavor == M31_FLASH:
        sparse = text["sparse_attention_config"]
        sparse["sparse_attention_freq"] = [1] * text["num_hidden_layers"]
        sparse["sparse_disable_index_value"] = [1] * text["num_hidden_layers"]
        sparse["sparse_init_block"] = 1
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 14,
              "image_size": 56}
    return {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
            "torch_dtype": "bfloat16", "text_config": text, "vision_config": vision,
            "image_token_index": 200025, "video_token_index": 200026,
            "projector_hidden_size": 64, "tie_word_embeddings": False}


# quantised fixtures: every reduction width split over TP 2 or 4 stays a multiple of 32
QUANTIZED_WIDTHS = {"intermediate_size": 128, "dense_intermediate_size": 128, "shared_intermediate_size": 128}
# mxfp8-nvfp4: M3.1-Flash's mixed layout (MXFP8, routed experts in compressed-tensors NVFP4)
QUANTIZED = ("mxfp8", "nvfp4-modelopt", "nvfp4-ct", "mxfp4-quark", "mxfp8-nvfp4")
# a module every quantised fixture leaves unquantised through its config's exclusion list
EXCLUDED_MODULE = "language_model.model.layers.0.mlp.down_proj"


def quantization_config(quantization: str, modules: list[str]) -> dict:
    """The fixture's quantization_config (`modules`: the canonical quantisable linears)."""
    from m3serve.model.formats import compressed_tensors, modelopt, mxfp8, quark
    if quantization in ("mxfp8", "mxfp8-nvfp4"):
        return mxfp8.config(["language_model.lm_head", "*block_sparse_moe.gate", EXCLUDED_MODULE],
                            nvfp4_experts=quantization == "mxfp8-nvfp4")
    if quantization == "nvfp4-modelopt":
        layers = {"language_model." + m: "NVFP4" if ".experts." in m else "MXFP8" for m in modules}
        return modelopt.config(layers, ["language_model.lm_head", "*block_sparse_moe.gate", EXCLUDED_MODULE])
    if quantization == "nvfp4-ct":
        return compressed_tensors.config(["language_model.lm_head", r"re:.*block_sparse_moe\.gate$",
                                          r"re:.*self_attn\..*", EXCLUDED_MODULE])
    if quantization == "mxfp4-quark":
        return quark.config()
    raise ValueError(f"quantization: unsupported value {quantization!r} for make-tiny "
                     f"(supported: {', '.join(QUANTIZED)})")


def _fused_group(module: str) -> str:
    """Linears one serving weight fuses (they share an NVFP4 global scale, as vLLM expects)."""
    for part, group in ((".self_attn.", "qkv"), (".mlp.", "mlp"), (".shared_experts.", "shared")):
        if part in module and not module.endswith(("o_proj", "down_proj")):
            return module.rsplit(".", 1)[0] + "/" + group
    if module.endswith((".w1", ".w3")):
        return module.rsplit(".", 1)[0] + "/w13"
    return module


def quantized_weights(cfg, raw: dict, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical bf16 weights -> checkpoint tensors in the layout `raw`'s quantization_config
    describes (original names without the `language_model.` prefix)."""
    from m3serve.model.formats import detect_scheme, quantizable_modules
    from m3serve.model.formats.layouts import layout, quantize_for_layout
    scheme = detect_scheme(raw)
    out = dict(weights)
    layouts = {m: layout(scheme, m) for m in quantizable_modules(cfg)}
    amax: dict[str, torch.Tensor] = {}
    for m, lay in layouts.items():
        if lay is not None:
            g = _fused_group(m)
            amax[g] = torch.maximum(amax.get(g, torch.tensor(0.0)), weights[m + ".weight"].float().abs().amax())
    for m, lay in layouts.items():
        if lay is None:
            continue
        del out[m + ".weight"]
        for suffix, t in quantize_for_layout(lay, weights[m + ".weight"], amax[_fused_group(m)]).items():
            out[f"{m}.{suffix}"] = t.contiguous()
    return out


def random_weights(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in canonical names, scaled so activations stay O(1) and logits are peaky
    (an initialiser's std 0.02 would make every next-token distribution near-uniform)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in canonical_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.randn(shape, generator=gen) * 0.1          # offsets from 1 (Gemma norm)
        elif name.endswith("e_score_correction_bias"):
            t = torch.randn(shape, generator=gen) * 0.05
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen)
        else:
            scale = 3.0 if name == "lm_head.weight" else 1.0
            t = torch.randn(shape, generator=gen) * scale / shape[-1] ** 0.5
        is_router = name.endswith(("gate.weight", "e_score_correction_bias")) and "block_sparse_moe" in name
        out[name] = t.to(torch.float32 if is_router else torch.bfloat16).contiguous()
    return out


# the vision tower of `make_tiny(vision=True)`: the real structure at small widths; head 20 keeps
# the real model's RoPE shape (3 axes x 6 channels rotated, the last 2 channels passed through)
TINY_VISION = {"model_type": "clip_vision_model", "hidden_size": 40, "intermediate_size": 80,
               "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 14, "image_size": 56,
               "num_channels": 3, "layer_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "gelu",
               "vision_segment_max_frames": 4,
               "img_token_compression_config": {"image_token_compression_method": "patch_merge",
                                                "spatial_merge_size": 2, "temporal_patch_size": 2}}


def random_vision_weights(raw: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random vision, projector and merge-MLP tensors in the original names (fp32 patch
    convolution, bf16 rest, as the real checkpoint), from their own generator so the text
    weights do not depend on whether a vision tower is written."""
    from m3serve.model.vision import parse_vision_config, vision_shapes
    vcfg = parse_vision_config(raw["vision_config"], raw["projector_hidden_size"],
                               raw["text_config"]["hidden_size"])
    gen = torch.Generator().manual_seed(seed + 7919)
    out = {}
    for name, shape in vision_shapes(vcfg).items():
        if len(shape) == 1:
            base = 1.0 if name.endswith("norm1.weight") or name.endswith("norm2.weight") \
                or name.endswith("layrnorm.weight") else 0.0
            t = base + torch.randn(shape, generator=gen) * 0.1
        else:
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            t = torch.randn(shape, generator=gen) / fan_in ** 0.5
        dtype = torch.float32 if "patch_embedding" in name else torch.bfloat16
        out[name] = t.to(dtype).contiguous()
    return out


def make_tiny(out_dir: str | Path, seed: int = 0, flavor: str = "m3", vision: bool = False,
              quantization: str | None = None) -> Path:
    """Write the tiny checkpoint of `flavor` into `out_dir` (created if needed). Same seed,
    flavor, vision and quantization -> same bytes.
    `vision` adds a small vision tower, projector and merge MLP (`TINY_VISION`) and points the
    image / video placeholder ids at the tokenizer's markers; the text weights stay the same.
    `quantization`: one of `QUANTIZED` (wider MLPs, text weights in that checkpoint layout)."""
    from m3serve.model.tokenizer_build import special_token_ids, write_tiny_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(out)                 # the stored TINY_VOCAB-token tokenizer
    ids = special_token_ids(out)
    raw = tiny_config_dict(TINY_VOCAB, bos_token_id=ids["bos"], eos_token_id=ids["eos"], flavor=flavor)
    if vision:
        raw["vision_config"] = dict(TINY_VISION)
        raw["image_token_index"], raw["video_token_index"] = ids["image"], ids["video"]
    if quantization is not None:
        from m3serve.model.formats import quantizable_modules
        raw["text_config"].update(QUANTIZED_WIDTHS)
        raw["quantization_config"] = quantization_config(quantization, quantizable_modules(parse_config(raw)))
    cfg = parse_config(raw)
    weights = random_weights(cfg, seed)
    if quantization is not None:
        weights = quantized_weights(cfg, raw, weights)
    weights = {"language_model." + k: v for k, v in weights.items()}
    if vision:
        weights.update(random_vision_weights(raw, seed))
    # written as the other files are, so the mode follows the umask (save_file makes it 0600)
    (out / "model.safetensors").write_bytes(safetensors_bytes(weights, metadata={"format": "pt"}))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": raw["text_config"]["bos_token_id"],
         "eos_token_id": raw["text_config"]["eos_token_id"]}, indent=2) + "\n")
    return out
