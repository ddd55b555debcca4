"""`m3serve make-tiny DIR --draft eagle3|eagle3-gqa|mtp [--target DIR]`: a random draft
checkpoint in the real layouts, sized for a target checkpoint (default: the embedded tiny model).

- eagle3 / eagle3-gqa: the Inferact layout (`config.json` with `eagle_config`, `midlayer.*`,
  `fc`, `norm`, `lm_head` over a draft vocabulary of half the target's, `d2t`, `t2d`); MHA has
  as many KV heads as query heads, GQA the target's KV head count.
- mtp: a standalone MTP checkpoint (`model_type` minimax_m3_mtp, `model.mtp.layers.{m}.*` with
  the target layer's original tensor names).
- dspark: the released DSpark layout in `DIR/dspark/` (write it into the target's folder to
  have the target find it): `DSparkMiniMaxDraftModel`, the released config keys (under
  `text_config`, a few repeated at the top level), MXFP8 projections with E8M0 scales; the
  released values for a real-shape target, scaled for a small one (taps spread over its
  layers like the release's 3, 17, 31, 45, 59 of 60, two layers, a 32-token window).
`--no-weights` writes only config.json (serve it with `--load-format dummy`: real-shape drafts
are gigabytes).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from m3serve.model.config import layer_shapes, load_config

DRAFT_KINDS = ("eagle3", "eagle3-gqa", "mtp", "dspark")
NUM_TINY_MTP_MODULES = 2


def _target_text_config(target_dir: Path) -> dict:
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    return dict(raw.get("text_config", raw))


def eagle3_config_dict(target_dir: Path, gqa: bool) -> dict:
    """The Inferact head's config keys, sized for the target. A real-shape target that is one
    tensor-parallel rank's view (`bench make-realshape --tp-rank N`) gets the layer cut like the
    engine splits it over N ranks by default (`draft_tensor_parallel_size` = the target's): its
    heads (the target's, already cut) and its MLP width over N; `fc` stays whole (replicated).
    The draft vocabulary is the target's up to 32000 (at a rank: the target's cut head, which
    the head then shares, as the model card says the released head is served)."""
    cfg = load_config(target_dir)
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    real = H >= 4096
    heads = cfg.num_attention_heads
    cut = max(1, 64 // heads) if real else 1
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": H, "num_attention_heads": heads,
        "num_key_value_heads": cfg.num_key_value_heads if gqa else heads, "head_dim": cfg.head_dim,
        "intermediate_size": 16384 // cut if real else 2 * H, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0 if not real else 5000000.0,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": min(32000, cfg.vocab_size) if real else cfg.vocab_size // 2, "target_hidden_size": H,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"use_aux_hidden_state": True,
                         "eagle_aux_hidden_state_layer_ids": [2, L // 2, L - 3] if L >= 6 else
                         [min(i, L - 1) for i in (1, 2, 3)]},
    }


def _random(shape, gen, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale / shape[-1] ** 0.5).to(torch.bfloat16)


def make_draft(out_dir: str | Path, kind: str, target_dir: str | Path | None = None, seed: int = 0,
               weights: bool = True) -> Path:
    if kind not in DRAFT_KINDS:
        raise ValueError(f"--draft must be one of {list(DRAFT_KINDS)}, got {kind!r}")
    if target_dir is None:
        from m3serve.model.files import default_model_dir
        target_dir = default_model_dir()
    target_dir, out = Path(target_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    if kind == "dspark":
        out = out / "dspark"
        out.mkdir(exist_ok=True)
        raw = dspark_config_dict(target_dir)
        (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        if weights:
            save_file(_dspark_weights(out, target_dir, gen), str(out / "model.safetensors"),
                      metadata={"format": "pt"})
        return out
    if kind == "mtp":
        raw = {"architectures": ["MiniMaxM3MTP"], **_target_text_config(target_dir),
               "model_type": "minimax_m3_mtp", "num_mtp_modules": NUM_TINY_MTP_MODULES}
        (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        if weights:
            save_file(_mtp_weights(target_dir, gen), str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    raw = eagle3_config_dict(target_dir, gqa=kind == "eagle3-gqa")
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if weights:
        save_file(_eagle3_weights(raw, gen), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _eagle3_weights(raw: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    from m3serve.spec_decode.eagle3 import Eagle3Config, eagle3_shapes

    cfg = Eagle3Config(raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"],
                       raw["head_dim"], raw["intermediate_size"], raw["rms_norm_eps"], raw["rope_theta"],
                       raw["vocab_size"], raw["draft_vocab_size"], raw["target_hidden_size"], ())
    out = {}
    for name, shape in eagle3_shapes(cfg, own_lm_head=True, own_embedding=False).items():
        key = name.replace("layers.0.", "midlayer.")
        if name == "d2t":
            continue
        out[key] = (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16) if len(shape) == 1 \
            else _random(shape, gen, 3.0 if name == "lm_head.weight" else 1.0)
    # the draft vocabulary: every other target id
    draft_ids = torch.arange(cfg.draft_vocab_size) * (cfg.vocab_size // cfg.draft_vocab_size)
    out["d2t"] = (draft_ids - torch.arange(cfg.draft_vocab_size)).to(torch.int64)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    out["t2d"] = t2d
    return out


def _mtp_weights(target_dir: Path, gen: torch.Generator) -> dict[str, torch.Tensor]:
    cfg = load_config(target_dir)
    H = cfg.hidden_size
    out = {}
    for m in range(NUM_TINY_MTP_MODULES):
        p = f"model.mtp.layers.{m}."
        for norm in ("enorm", "hnorm", "final_layernorm"):
            out[p + norm + ".weight"] = (0.1 * torch.randn(H, generator=gen)).to(torch.bfloat16)
        out[p + "eh_proj.weight"] = _random((H, 2 * H), gen)
        for name, shape in layer_shapes(cfg, p + "transformer_layer.", sparse=True, moe=True).items():
            if name.endswith(("gate.weight", "e_score_correction_bias")):
                scale = 0.05 if name.endswith("bias") else 1.0
                out[name] = (torch.randn(shape, generator=gen) * scale / shape[-1] ** 0.5).float()
            elif len(shape) == 1:
                out[name] = (0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
            else:
                out[name] = _random(shape, gen)
    return out


RELEASED_DSPARK_TAPS = (3, 17, 31, 45, 59)      # of 60 target layers


def dspark_config_dict(target_dir: Path, replicated: bool = False) -> dict:
    """The released dspark/config.json's keys, sized for the target. A real-shape target gets
    the released values, cut like the target when it is one tensor-parallel rank's view
    (`bench make-realshape --tp-rank N`: its heads, KV heads and FFN width over N), unless
    `replicated` (the released widths whatever the target: a draft each rank runs whole)."""
    cfg = load_config(target_dir)
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    real = H >= 4096
    cut = 1 if replicated or not real else max(1, 64 // cfg.num_attention_heads)
    text = {
        "num_hidden_layers": 5 if real else 2, "hidden_size": H, "vocab_size": cfg.vocab_size,
        "num_attention_heads": 64 // cut if real else cfg.num_attention_heads,
        "num_key_value_heads": max(1, 4 // cut) if real else cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "dense_intermediate_size": 12288 // cut if real else 2 * H,
        "dspark_ffn_hidden_size": 12288 // cut if real else 2 * H,
        "dspark_markov_rank": 256 if real else 16, "dspark_markov_head_type": "vanilla",
        "dspark_block_size": 7, "dspark_noise_token_id": cfg.vocab_size - 6,
        "dspark_target_layer_ids": [min(L - 1, t * L // 60) for t in RELEASED_DSPARK_TAPS],
        "sliding_window": 4096 if real else 32, "dspark_use_dense_ffn": True, "sparse_attention_config": None,
        "dspark_hybrid_context_fusion": False, "dspark_config": {"hybrid_context_fusion": False},
        "enable_confidence_head": True, "confidence_head_with_markov": True, "use_gemma_norm": True,
        "rms_norm_eps": cfg.rms_norm_eps,
    }
    text["moe_layer_freq"] = [0] * text["num_hidden_layers"]
    text["layer_types"] = ["sliding_attention"] * text["num_hidden_layers"]
    return {"architectures": ["DSparkMiniMaxDraftModel"], "model_type": "minimax_m3_dspark",
            "quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, 32]},
            "dspark_block_size": text["dspark_block_size"], "hidden_size": H, "text_config": text}


def _dspark_weights(draft_dir: Path, target_dir: Path, gen: torch.Generator) -> dict[str, torch.Tensor]:
    from m3serve.kernels.ref.packed import quantize_mxfp8
    from m3serve.spec_decode.dspark import PREFIX, dspark_shapes, load_dspark_config

    cfg = load_dspark_config(draft_dir, load_config(target_dir))
    out = {}
    for name, shape in dspark_shapes(cfg, cfg.hidden_size).items():
        if name.endswith("weight_scale_inv"):
            continue
        if name == "confidence_head.proj.bias":
            out[PREFIX + name] = torch.zeros(shape, dtype=torch.bfloat16)
        elif len(shape) == 1:
            out[PREFIX + name] = (0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        elif name.startswith("layers.") and name.endswith("_proj.weight"):
            codes, scales = quantize_mxfp8(_random(shape, gen).float())
            out[PREFIX + name], out[PREFIX + name[:-len("weight")] + "weight_scale_inv"] = codes, scales
        else:
            out[PREFIX + name] = _random(shape, gen, 3.0 if name.startswith("markov") else 1.0)
    return out
