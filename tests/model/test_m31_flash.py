"""The MiniMax-M3.1-Flash flavor (MSA and an index cache in every layer) on its tiny checkpoint:
the serving model equals the dense reference, layer by layer choice of blocks included; the
engine's greedy tokens equal the reference's under chunked prefill and prefix hits; both cache
groups span every layer; the config's unconfirmed M3.1 facts are read, not assumed."""
import json

import pytest
import torch

from m3serve.core.kv_cache.specs import cache_group_specs
from m3serve.llm import LLM
from m3serve.model.config import load_config, parse_config
from m3serve.model.loader import load_model
from m3serve.model.tiny import tiny_config_dict
from m3serve.sampling_params import SamplingParams
from paged import PagedRunner
from refgreedy import greedy_after_shared_prefix, paged_against_reference, reference_greedy, reference_model


@pytest.fixture(scope="module")
def reference(tiny_m31_dir):
    return reference_model(tiny_m31_dir)


def test_every_layer_is_sparse_with_its_index_cache(tiny_m31_dir):
    cfg = load_config(tiny_m31_dir)
    assert cfg.flavor == "m3.1-flash"
    assert cfg.sparse_layer_ids == [0, 1, 2, 3, 4]
    assert cfg.mlp_layer_types == ("dense", "dense", "sparse", "sparse", "sparse")
    assert cfg.index_init_blocks == 1
    specs = {s.name: s for s in cache_group_specs(cfg, 2, 4, 4)}
    assert specs["index"].layer_ids == (0, 1, 2, 3, 4)
    model, _, _ = load_model(tiny_m31_dir, dtype="float32", progress=False)
    runner = PagedRunner(model, num_blocks=8)
    assert all(c is not None and c.shape == (8, 16, 32) for c in runner.runner.index_caches)
    assert all(a.is_sparse for a in model.attention_layers)
    # the pool is sized with 5 index layers: fp32, per token 5 x (K+V 2 x 2 heads x 32 x 4 B) +
    # 5 x (index key 32 x 4 B) = 3200 B (the M3 flavor's 3 index layers would make it 2944 B: 21 blocks)
    llm = LLM(model=str(tiny_m31_dir), dtype="float32", kv_cache_memory=20 * 16 * 3200)
    assert llm.engine.worker.num_blocks == 20


def test_reference_equals_serving_model(tiny_m31_dir, reference):
    model, _, _ = load_model(tiny_m31_dir, dtype="float32", progress=False)
    ids = torch.randint(0, 2000, (180,), generator=torch.Generator().manual_seed(5))
    ours, ref_sel = paged_against_reference(model, reference, ids)
    assert len(ref_sel) == 5                                 # one selection per layer
    for a, b in zip(ours, ref_sel):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)
    # block 0 (sparse_init_block 1) is chosen by every query of layer 0, also far from it
    assert (ref_sel[0][-1] == 0).any(-1).all()


def test_engine_greedy_equals_reference_chunked_and_prefix_hit(tiny_m31_dir, reference):
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 2000, (70,), generator=g).tolist()
    a = shared + torch.randint(0, 2000, (25,), generator=g).tolist()
    b = shared + torch.randint(0, 2000, (40,), generator=g).tolist()
    want = [reference_greedy(reference, p, 6) for p in (a, b)]
    llm = LLM(model=str(tiny_m31_dir), dtype="float32", max_num_batched_tokens=24)
    assert greedy_after_shared_prefix(llm, a, b, chunk=24) == want


def _text(raw: dict) -> dict:
    return raw["text_config"]


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t["sparse_attention_config"].pop("sparse_init_block"), "sparse_init_block.*is missing"),
    (lambda t: t["sparse_attention_config"].update(sparse_init_block=2),
     r"sparse_attention_config.sparse_init_block=2 is not a known layout"),
    (lambda t: t.pop("num_experts_per_tok"), "num_experts_per_tok is missing"),
    (lambda t: t["sparse_attention_config"].pop("sparse_topk_blocks"), "sparse_topk_blocks.*is missing"),
    (lambda t: t["sparse_attention_config"]["sparse_disable_index_value"].__setitem__(0, 0),
     r"layers \[0\] are sparse with an index value projection"),
])
def test_unconfirmed_m31_facts_are_read_not_assumed(edit, needle):
    raw = tiny_config_dict(flavor="m3.1-flash")
    parse_config(raw)                                         # as written: accepted
    edit(_text(raw))
    with pytest.raises(ValueError, match=needle):
        parse_config(raw)


def test_a_missing_m31_fact_can_be_supplied_with_hf_overrides(tmp_path):
    from m3serve.model.config import apply_overrides
    raw = tiny_config_dict(flavor="m3.1-flash")
    del _text(raw)["sparse_attention_config"]["sparse_init_block"]
    with pytest.raises(ValueError, match="sparse_init_block"):
        parse_config(raw)
    cfg = parse_config(apply_overrides(raw, {"sparse_attention_config": {"sparse_init_block": 0}}))
    assert (cfg.flavor, cfg.index_init_blocks, cfg.index_topk_blocks) == ("m3.1-flash", 0, 4)


def test_full_size_m31_values_outside_the_reported_ones_fail():
    from m3serve.model.known_configs import known_config
    raw = known_config("MiniMaxAI/MiniMax-M3.1-Flash").load()
    assert parse_config(raw).flavor == "m3.1-flash"
    for key, value in (("num_experts_per_tok", 6), ("num_experts_per_tok", 8)):
        _text(raw)[key] = value
        if value == 8:
            assert parse_config(raw).num_experts_per_tok == 8      # the fixture's value: known
        else:
            with pytest.raises(ValueError, match=f"num_experts_per_tok={value} is not a known layout"):
                parse_config(raw)
    _text(raw)["num_experts_per_tok"] = 4
    _text(raw)["sparse_attention_config"]["sparse_topk_blocks"] = 8
    with pytest.raises(ValueError, match="sparse_topk_blocks=8 is not a known layout"):
        parse_config(raw)


def test_missing_index_projection_in_a_dense_mlp_layer_is_named(tiny_m31_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    for f in tiny_m31_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["language_model.model.layers.0.self_attn.index_k_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model.layers.0.self_attn.index_k_proj.weight'\]"):
        load_model(tmp_path, dtype="float32", progress=False)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["sparse_attention_config"][
        "sparse_attention_freq"] == [1] * 5


def test_llm_chat_takes_the_reasoning_effort_through_chat_template_kwargs(tiny_m31_dir):
    llm = LLM(model=str(tiny_m31_dir), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ask = [{"role": "user", "content": "hi"}]
    [out] = llm.chat(ask, params, use_tqdm=False, chat_template_kwargs={"reasoning_effort": "medium"})
    assert out.prompt.startswith("]~!b[]~b]system\n<effort>medium</effort>[e~[\n")
    with pytest.raises(ValueError, match="chat_template_kwargs.reasoning_effort must be one of"):
        llm.chat(ask, params, use_tqdm=False, chat_template_kwargs={"reasoning_effort": "ultra"})


def test_make_tiny_flavor_cli_is_deterministic_and_checked(tmp_path, tiny_m31_dir, capsys):
    from m3serve.cli import main
    assert main(["make-tiny", str(tmp_path / "a"), "--flavor", "m3.1-flash"]) == 0
    for f in ("model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "a" / f).read_bytes() == (tiny_m31_dir / f).read_bytes(), f
    with pytest.raises(SystemExit):
        main(["make-tiny", str(tmp_path / "b"), "--flavor", "m3.2"])
    assert "invalid choice: 'm3.2'" in capsys.readouterr().err
    assert main(["make-tiny", str(tmp_path / "c"), "--flavor", "m3.1-flash", "--draft", "mtp"]) != 0
    assert "--flavor picks the target model's layout" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
