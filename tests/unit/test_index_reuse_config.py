"""Cross-layer top-k reuse in the config: which sparse layers run the indexer on the real
60-layer schedule and the tiny ones (an independent enumeration and literal lists), the keys'
checks (each bad value a ValueError naming its key; the keys refused at the top level of a VL
config), and what dropping the skipped layers' index cache and projections does to the cache
groups, the planner's bytes and the layers the engine builds."""
import json

import pytest
import torch

from m3serve.bench.realshape import realshape_config_dict, write_realshape_dir
from m3serve.config import ParallelConfig
from m3serve.core.kv_cache.specs import cache_group_specs
from m3serve.model.config import apply_overrides, parse_config
from m3serve.model.tiny import tiny_config_dict
from m3serve.plan import plan


def _with(raw: dict, **text) -> dict:
    return apply_overrides(raw, {"text_config": text})


def _real(**text):
    return parse_config(_with(realshape_config_dict(60, dense_layers=3), **text))


def _computing_by_hand(sparse_ids, freq, offset):
    """The rule spelt out: ordinal n runs the indexer iff max(n - offset, 0) % freq == 0."""
    return [lid for n, lid in enumerate(sparse_ids) if max(n - offset, 0) % freq == 0]


def test_real_schedule_every_fourth_sparse_layer():
    cfg = _real(use_index_cache=True, index_topk_freq=4)
    assert cfg.index_layer_ids == list(range(3, 60, 4)) and len(cfg.index_layer_ids) == 15
    assert [cfg.index_source(i) for i in (3, 4, 5, 6, 7, 58, 59)] == [3, 3, 3, 3, 7, 55, 59]
    assert not cfg.computes_index(0) and cfg.computes_index(3)


@pytest.mark.parametrize("freq,offset", [(2, 0), (3, 0), (4, 2), (2, 5), (8, 1)])
def test_rule_equals_an_enumeration(freq, offset):
    cfg = _real(use_index_cache=True, index_topk_freq=freq, index_skip_topk_offset=offset)
    want = _computing_by_hand(list(range(3, 60)), freq, offset)
    assert cfg.index_layer_ids == want
    # the first `offset + 1` sparse layers all run it; a skipping layer reads the latest one before it
    assert want[:offset + 1] == list(range(3, 3 + offset + 1))
    for lid in range(3, 60):
        assert cfg.index_source(lid) == max(i for i in want if i <= lid)


def test_tiny_schedules():
    m3 = tiny_config_dict()
    assert parse_config(_with(m3, use_index_cache=True, index_topk_freq=2)).index_layer_ids == [1, 3]
    assert parse_config(_with(m3, use_index_cache=True, index_topk_freq=4)).index_layer_ids == [1]
    flash = tiny_config_dict(flavor="m3.1-flash")
    cfg = parse_config(_with(flash, use_index_cache=True, index_topk_freq=2, index_skip_topk_offset=1))
    assert cfg.index_layer_ids == [0, 1, 3]
    assert [cfg.index_source(i) for i in range(5)] == [0, 1, 1, 3, 3]


@pytest.mark.parametrize("text", [{}, {"use_index_cache": False, "index_topk_freq": 4},
                                  {"use_index_cache": True, "index_topk_freq": 1}],
                         ids=["absent", "off", "freq-1"])
def test_off_and_freq_one_run_every_indexer(text):
    cfg = _real(**text)
    assert cfg.index_topk_freq == 1 and cfg.index_layer_ids == cfg.sparse_layer_ids
    assert parse_config(realshape_config_dict(60, dense_layers=3)) == cfg


@pytest.mark.parametrize("text,key", [
    ({"use_index_cache": True, "index_topk_freq": 0}, "index_topk_freq"),
    ({"use_index_cache": True, "index_topk_freq": -2}, "index_topk_freq"),
    ({"use_index_cache": True, "index_topk_freq": 2.5}, "index_topk_freq"),
    ({"use_index_cache": True, "index_topk_freq": "4"}, "index_topk_freq"),
    ({"use_index_cache": True, "index_topk_freq": True}, "index_topk_freq"),
    ({"use_index_cache": True}, "index_topk_freq"),                          # F is required
    ({"use_index_cache": True, "index_topk_freq": 4, "index_skip_topk_offset": -1}, "index_skip_topk_offset"),
    ({"use_index_cache": True, "index_topk_freq": 4, "index_skip_topk_offset": 1.5}, "index_skip_topk_offset"),
    ({"use_index_cache": "true", "index_topk_freq": 4}, "use_index_cache"),
    ({"index_topk_freq": 4}, "index_topk_freq"),                            # no effect without the switch
    ({"index_skip_topk_offset": 1}, "index_skip_topk_offset"),
])
def test_bad_values_name_the_key(text, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        _real(**text)


def test_top_level_keys_are_refused_with_the_nesting_to_use():
    raw = realshape_config_dict(60, dense_layers=3)
    for overrides in ({"use_index_cache": True, "index_topk_freq": 4},
                      {"text_config": {"use_index_cache": True}, "index_topk_freq": 4}):
        with pytest.raises(ValueError, match=r"top level.*text_config.*--hf-overrides"):
            parse_config(apply_overrides(raw, overrides))
    in_file = dict(raw, use_index_cache=True)                          # the VL config.json itself
    with pytest.raises(ValueError, match="'use_index_cache' is at the top level"):
        parse_config(in_file)
    # other text keys still reach text_config from the top level
    assert parse_config(apply_overrides(raw, {"rms_norm_eps": 1e-5})).rms_norm_eps == 1e-5


def test_bare_text_config_takes_either_placement():
    text = realshape_config_dict(60, dense_layers=3)["text_config"]
    keys = {"use_index_cache": True, "index_topk_freq": 4}
    nested = parse_config(apply_overrides(text, {"text_config": keys}))
    top = parse_config(apply_overrides(text, keys))
    assert nested == top and nested.index_layer_ids == list(range(3, 60, 4))


def test_cache_groups_and_planner_count_only_indexer_layers():
    cfg = _real(use_index_cache=True, index_topk_freq=4)
    specs = {s.name: s for s in cache_group_specs(cfg, 1, 2, 2)}
    assert specs["index"].layer_ids == tuple(range(3, 60, 4))
    assert specs["main"].layer_ids == tuple(range(60))
    exact = plan(_real(), ParallelConfig(tensor_parallel_size=8))
    reuse = plan(cfg, ParallelConfig(tensor_parallel_size=8))
    # one bf16 index key of 128 per token in 15 layers instead of 57; K/V unchanged
    assert reuse.kv_bytes_per_token == {"main": 60 * 2 * 128 * 2, "index": 15 * 128 * 2}
    assert exact.kv_bytes_per_token["index"] == 57 * 128 * 2
    # 42 layers without index_q (1 of 4 heads at TP 8) + index_k rows and their two norms
    dropped = 42 * ((128 + 128) * 6144 + 2 * 128) * 2
    assert exact.total_weight_bytes - reuse.total_weight_bytes == dropped


@pytest.mark.parametrize("tp", [1, 8])
def test_planner_equals_the_layers_the_engine_builds(tp):
    from m3serve.distributed import GroupInfo, ParallelInfo
    from m3serve.model.minimax_m3 import MiniMaxM3ForCausalLM

    cfg = parse_config(_with(realshape_config_dict(6, dense_layers=1), use_index_cache=True, index_topk_freq=2))
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(cfg, ParallelInfo(GroupInfo(0, tp)), torch.bfloat16)
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    assert built == plan(cfg, ParallelConfig(tensor_parallel_size=tp)).total_weight_bytes
    attn = model.attention_layers
    assert [a.computes_index for a in attn] == [False, True, False, True, False, True]
    assert [a.is_sparse for a in attn] == [False] + [True] * 5
    assert not hasattr(attn[2], "indexer") and "index_q" not in attn[2].qkv_proj.sections


def test_plan_command_takes_hf_overrides(tmp_path, capsys):
    from m3serve.cli import main

    d = write_realshape_dir(tmp_path / "m3", 60, dense_layers=3)
    reuse = json.dumps({"text_config": {"use_index_cache": True, "index_topk_freq": 4}})
    assert main(["plan", str(d), "-tp", "8", "--hf-overrides", reuse, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["index_cache_layers"] == 15 and out["index_topk_freq"] == 4
    assert out["kv_bytes_per_token_per_gpu"] == 60 * 2 * 128 * 2 + 15 * 128 * 2
    assert main(["plan", str(d), "-tp", "8", "--hf-overrides", reuse]) == 0
    assert "15 of 57 sparse layers run the indexer" in capsys.readouterr().out
    top = json.dumps({"use_index_cache": True, "index_topk_freq": 4})
    assert main(["plan", str(d), "-tp", "8", "--hf-overrides", top]) == 2
    assert "text_config" in capsys.readouterr().err
