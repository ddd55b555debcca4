"""Real-shape MiniMax-M3 for one GPU: the real layer shapes (hidden 6144, 64/4 heads of 128,
index 4 + 1 heads, 128 experts of 3072 top-4 + shared, dense MLP 12288, vocab 200064) with the
depth cut to L layers (layer 0 dense attention + dense MLP, the rest sparse + MoE).

`m3serve bench make-realshape DIR --layers L` writes a checkpoint directory holding only
config.json plus the tiny tokenizer and chat template; serve or load it with
`--load-format dummy`, so the engine and server run it exactly as they would a checkpoint.
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


def write_realshape_dir(out_dir: str | Path, num_layers: int, dense_layers: int = 1) -> Path:
    """config.json (real shapes, L layers) + the tiny model's tokenizer files, its vocabulary
    widened to the real size (see `_widen_vocab`) so that every token the model can emit has
    text, as with a real checkpoint (streaming and ITL measure per text chunk)."""
    from m3serve.model.files import default_model_dir

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = realshape_config_dict(num_layers, dense_layers=dense_layers)
    tiny = default_model_dir()
    tiny_text = json.loads((tiny / "config.json").read_text())["text_config"]
    raw["text_config"]["bos_token_id"] = tiny_text["bos_token_id"]
    raw["text_config"]["eos_token_id"] = tiny_text["eos_token_id"]
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
