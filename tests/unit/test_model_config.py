"""Config parsing: the VL wrapper and bare text configs, legacy and flat names, bad values."""
import copy

import pytest

from m3serve.model.config import FULL, SPARSE, parse_config
from m3serve.model.tiny import tiny_config_dict


def real_text_config() -> dict:
    """The real MiniMax-M3 text_config (docs/model.md §1.2), in the checkpoint's legacy naming."""
    return {
        "hidden_size": 6144, "intermediate_size": 3072, "dense_intermediate_size": 12288,
        "shared_intermediate_size": 3072, "num_hidden_layers": 60, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 200064,
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "rope_theta": 5000000,
        "rotary_dim": 64, "partial_rotary_factor": 0.5, "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "num_local_experts": 128,
        "num_experts_per_tok": 4, "n_shared_experts": 1, "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.0, "moe_layer_freq": [0, 0, 0] + [1] * 57,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_num_index_heads": 4, "sparse_index_dim": 128,
            "sparse_block_size": 128, "sparse_topk_blocks": 16, "sparse_local_block": 1,
            "sparse_init_block": 0, "sparse_score_type": "max",
            "sparse_attention_freq": [0, 0, 0] + [1] * 57},
    }


def test_real_config_schedule():
    cfg = parse_config({"model_type": "minimax_m3_vl", "text_config": real_text_config(),
                        "vision_config": {"hidden_size": 1280}})
    assert cfg.layer_types[:3] == (FULL,) * 3 and cfg.layer_types[3:] == (SPARSE,) * 57
    assert cfg.mlp_layer_types[:3] == ("dense",) * 3 and set(cfg.mlp_layer_types[3:]) == {"sparse"}
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 5e6 and cfg.index_block_size == 128
    assert cfg.index_topk_blocks == 16 and cfg.index_n_heads == 4 and cfg.max_position_embeddings == 1048576
    assert cfg.vision_config == {"hidden_size": 1280}
    assert cfg.sparse_layer_ids == list(range(3, 60))


def test_bare_and_flat_names_give_the_same_config():
    legacy = parse_config(real_text_config())
    flat = real_text_config()
    sparse = flat.pop("sparse_attention_config")
    moe = flat.pop("moe_layer_freq")
    flat.update(index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16,
                index_local_blocks=1,
                layer_types=[SPARSE if f else FULL for f in sparse["sparse_attention_freq"]],
                mlp_layer_types=["sparse" if f else "dense" for f in moe],
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5})
    assert parse_config(flat) == legacy


@pytest.mark.parametrize("path, value, needle", [
    (("hidden_act",), "gelu", "hidden_act"),
    (("scoring_func",), "softmax", "scoring_func"),
    (("sparse_attention_config", "sparse_score_type"), "mean", "sparse_score_type"),
    (("sparse_attention_config", "sparse_block_size"), 24, "sparse_block_size"),
    (("sparse_attention_config", "sparse_attention_freq"), [0, 1], "sparse_attention_freq"),
    (("moe_layer_freq",), [1] * 59, "moe_layer_freq"),
    (("sparse_attention_config", "sparse_num_index_heads"), 2, "index_n_heads"),
    (("num_key_value_heads",), 5, "num_key_value_heads"),
    (("num_hidden_layers",), 0, "num_hidden_layers"),
])
def test_unsupported_values_name_the_field_and_value(path, value, needle):
    raw = real_text_config()
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ValueError) as err:
        parse_config(raw)
    assert needle in str(err.value) and repr(value)[:20] in str(err.value)


def test_missing_field():
    raw = real_text_config()
    del raw["vocab_size"]
    with pytest.raises(ValueError, match="'vocab_size' is missing"):
        parse_config(raw)


def test_tiny_config_mixes_layer_kinds():
    cfg = parse_config(tiny_config_dict())
    assert {FULL, SPARSE} == set(cfg.layer_types) and {"dense", "sparse"} == set(cfg.mlp_layer_types)
    assert cfg.index_block_size == 16 and cfg.rotary_dim == 16
    hf = copy.deepcopy(cfg.to_hf_text_dict())
    assert parse_config(hf) == cfg
