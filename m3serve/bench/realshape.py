"""Real-shape MiniMax-M3 for one GPU: the real layer shapes (hidden 6144, 64/4 heads of 128,
index 4 + 1 heads, 128 experts of 3072 top-4 + shared, dense MLP 12288, vocab 200064) with the
depth cut to L layers (the first `dense_layers` dense attention + dense MLP, the rest sparse + MoE).

`m3serve bench make-realshape DIR --layers L` writes a checkpoint directory holding only
config.json plus the tiny tokenizer and chat template; serve or load it with
`--load-format dummy`, so the engine and server run it exactly as they would a checkpoint.
`--tp-rank N` writes what one rank of a TP-N deployment holds instead (`rank_text_config`), so
that one GPU measures exactly one rank's compute at full depth (no collectives).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path


def realshape_config_dict(num_layers: int, max_position_embeddings: int = 1048576,
                          dense_layers: int = 1) -> dict:
    """Dense attention + dense MLP in the first `dense_layers` layers, MSA + MoE after them (the
    real model: 60 layers, 3 dense)."""
    if not 1 <= dense_layers < num_layers:
        raise ValueError(f"--layers {num_layers} must exceed --dense-layers {dense_layers} >= 1 "
                         f"(dense layers, then sparse ones)")
    lay = [0] * dense_layers + [1] * (num_layers - dense_layers)
    text = {
        "architectures": ["MiniMaxM3SparseForCausalLM"], "hidden_size": 6144, "intermediate_size": 3072,
        "dense_intermediate_size": 12288, "shared_intermediate_size": 3072, "num_hidden_layers": num_layers,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 200064,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6, "rope_theta": 5000000,
        "rotary_dim": 64, "partial_rotary_factor": 0.5, "hidden_act": "swigluoai", "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0, "num_local_experts": 128, "num_experts_per_tok": 4, "n_shared_experts": 1,
        "scoring_func": "sigmoid", "use_routing_bias": True, "routed_scaling_factor": 2.0,
        "moe_layer_freq": lay, "tie_word_embeddings": False,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_num_index_heads": 4, "sparse_index_dim": 128,
            "sparse_block_size": 128, "sparse_topk_blocks": 16, "sparse_local_block": 1,
            "sparse_init_block": 0, "sparse_score_type": "max", "sparse_attention_freq": lay,
            "sparse_disable_index_value": lay},
    }
    return {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
            "torch_dtype": "bfloat16", "text_config": text}


def rank_text_config(text: dict, tp: int, expert_parallel: bool = False,
                     full_vocab: bool = False) -> dict:
    """The text config of what rank 0 of a TP-`tp` engine holds, as a one-GPU model: query heads
    / tp; KV and index-query heads split while tp <= their count, else one (replicated, as the
    engine does); the shared expert and dense MLP at 1/tp width; the vocabulary-parallel
    embedding and head at ceil(V / tp) rows (`full_vocab` keeps V, to compare with a peer that
    keeps the whole head). Routed experts: 1/tp of every expert's width, or with
    `expert_parallel` E / tp whole experts behind the full router, computing only the rows
    routed to them (`expert_parallel_view`: rank 0's share of the dispatch). Shapes are those
    `layers/` builds for TP rank 0; indivisible widths raise the engine's own errors."""
    from m3serve.distributed import GroupInfo
    from m3serve.layers.linear import kv_head_range
    from m3serve.model.config import parse_config

    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp-rank must be a positive integer, got {tp!r}")
    cfg = parse_config(text)
    group = GroupInfo(0, tp)
    for name, width in (("num_attention_heads", cfg.num_attention_heads),
                        ("shared_intermediate_size", cfg.shared_intermediate_size),
                        ("dense_intermediate_size", cfg.dense_intermediate_size)) + (
            () if expert_parallel else (("intermediate_size", cfg.intermediate_size),)):
        if width % tp:
            raise ValueError(f"{name}={width} is not divisible by TP={tp}")
    if expert_parallel and cfg.num_local_experts % tp:
        raise ValueError(f"expert parallelism over {tp} ranks needs num_local_experts="
                         f"{cfg.num_local_experts} divisible by {tp}")
    out = dict(text)
    out.pop("n_shared_experts", None)
    kv = kv_head_range(cfg.num_key_value_heads, group)[1]
    out.update(num_attention_heads=cfg.num_attention_heads // tp, num_key_value_heads=kv,
               head_dim=cfg.head_dim,
               shared_intermediate_size=cfg.shared_intermediate_size // tp,
               dense_intermediate_size=cfg.dense_intermediate_size // tp,
               vocab_size=cfg.vocab_size if full_vocab else -(-cfg.vocab_size // tp))
    if expert_parallel:
        out["expert_parallel_view"] = {"rank": 0, "size": tp}
    else:
        out["intermediate_size"] = cfg.intermediate_size // tp
    index = kv_head_range(cfg.index_n_heads, group)[1]
    if "sparse_attention_config" in out:
        out["sparse_attention_config"] = {**out["sparse_attention_config"], "sparse_num_index_heads": index}
    if "index_n_heads" in out or "sparse_attention_config" not in out:
        out["index_n_heads"] = index
    out["rank_of"] = {"tensor_parallel_size": tp, "expert_parallel": bool(expert_parallel),
                      "full_vocab": bool(full_vocab)}
    return out


def write_realshape_dir(out_dir: str | Path, num_layers: int, dense_layers: int = 1,
                        tp_rank: int | None = None, expert_parallel: bool = False,
                        full_vocab: bool = False, vision: bool = False) -> Path:
    """config.json (real shapes, L layers; with `tp_rank` N, what one rank of TP N holds;
    with `vision`, the real vision tower's config, random under `--load-format dummy`) + the
    tiny model's tokenizer files, its vocabulary widened to the model's size (see
    `_widen_vocab`) so that every token the model can emit has text, as with a real checkpoint
    (streaming and ITL measure per text chunk)."""
    from m3serve.model.files import default_model_dir

    if tp_rank is None and (expert_parallel or full_vocab):
        raise ValueError("--ep and --full-vocab describe a rank: give --tp-rank N")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = realshape_config_dict(num_layers, dense_layers=dense_layers)
    if tp_rank is not None:
        raw["text_config"] = rank_text_config(raw["text_config"], tp_rank, expert_parallel, full_vocab)
    tiny = default_model_dir()
    tiny_text = json.loads((tiny / "config.json").read_text())["text_config"]
    raw["text_config"]["bos_token_id"] = tiny_text["bos_token_id"]
    raw["text_config"]["eos_token_id"] = tiny_text["eos_token_id"]
    if vision:
        from m3serve.model.known_configs import __path__ as known
        from m3serve.model.tokenizer_build import special_token_ids
        real = json.loads((Path(known[0]) / "MiniMax-M3.json").read_text())
        for key in ("vision_config", "projector_hidden_size", "projector_hidden_act", "multimodal_projector_bias",
                    "img_token_compression_config", "process_image_mode"):
            raw[key] = real[key]
        ids = special_token_ids(tiny)
        raw["image_token_index"], raw["video_token_index"] = ids["image"], ids["video"]
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / f, out / f)
    tokenizer = json.loads((tiny / "tokenizer.json").read_text(encoding="utf-8"))
    _widen_vocab(tokenizer, raw["text_config"]["vocab_size"])
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    return out


def _widen_vocab(tokenizer: dict, vocab_size: int) -> None:
    """Give every id the tiny byte-level BPE lacks (up to vocab_size) its own word, " q<id>": such
    ids decode to text but no merge ever produces them, so encoding is unchanged."""
    vocab = tokenizer["model"]["vocab"]
    for t in tokenizer["added_tokens"]:   # in the model's vocabulary too, or loading renumbers them
        vocab.setdefault(t["content"], t["id"])
    taken = set(vocab.values())
    for i in range(vocab_size):
        if i in taken:
            continue
        word = f"\u0120q{i}"                              # byte-level "Ġ" is the leading space
        while word in vocab:
            word += "q"
        vocab[word] = i
