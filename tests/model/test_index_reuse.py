"""Cross-layer top-k reuse on the tiny models' serving model: off (or F = 1) it is the exact model
bit for bit, greedy tokens included; on, run paged (chunked prefill, then decode) it equals the
dense reference that skips the indexer by the same rule, block choices included, for the M3
layout and the all-MSA M3.1-Flash one. The engine end to end: test_index_reuse_engine.py."""
import pytest
import torch

from m3serve.layers.attention import SharedSelection
from m3serve.model.loader import load_model
from m3serve.model.reference import ReferenceM3
from paged import PagedRunner
from refgreedy import canonical_weights, paged_against_reference


def reuse(freq: int, offset: int | None = None, use: bool = True) -> dict:
    text = {"use_index_cache": use, "index_topk_freq": freq}
    if offset is not None:
        text["index_skip_topk_offset"] = offset
    return {"text_config": text}


@pytest.fixture(scope="module")
def weights(tiny_dir):
    return canonical_weights(tiny_dir)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("overrides", [reuse(4, use=False), reuse(1)], ids=["off", "freq-1"])
def test_off_is_the_exact_model(tiny_dir, overrides):
    """Same config, same logits bit for bit over a chunked prefill, same greedy continuation."""
    exact, cfg, _ = load_model(tiny_dir, dtype="float32", progress=False)
    model, off_cfg, _ = load_model(tiny_dir, dtype="float32", progress=False, hf_overrides=overrides)
    assert off_cfg == cfg and off_cfg.index_layer_ids == [1, 2, 3]
    ids = _ids(150, 2)
    got, want = PagedRunner(model), PagedRunner(exact)
    assert torch.equal(torch.cat([got.step({0: ids[:100]}), got.step({0: ids[100:]})]),
                       torch.cat([want.step({0: ids[:100]}), want.step({0: ids[100:]})]))
    assert got.greedy(ids[:120], 6, sid=1) == want.greedy(ids[:120], 6, sid=1)


@pytest.mark.parametrize("freq,offset,computing", [(2, None, [1, 3]), (4, None, [1]), (2, 1, [1, 2])])
def test_serving_model_equals_the_reference_that_skips(tiny_dir, weights, freq, offset, computing):
    model, cfg, _ = load_model(tiny_dir, dtype="float32", progress=False, hf_overrides=reuse(freq, offset))
    assert cfg.index_layer_ids == computing
    attn = model.attention_layers
    assert [a.computes_index for a in attn] == [i in computing for i in range(5)]
    ids = torch.tensor(_ids(180, 5))
    ref = ReferenceM3(cfg, weights)
    ours, ref_sel = paged_against_reference(model, ref, ids)
    assert len(ref_sel) == 3
    for a, b in zip(ours, ref_sel):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)
    sparse = cfg.sparse_layer_ids
    for n, layer in enumerate(sparse):                # a skipping layer used its source's choice
        assert torch.equal(ours[n], ours[sparse.index(cfg.index_source(layer))])
    # and that choice is not what the exact model picks there: the skip changed the output
    from m3serve.model.config import load_config
    exact_logits, exact_sel = ReferenceM3(load_config(tiny_dir), weights).forward(ids)
    skipped = [n for n, layer in enumerate(sparse) if layer not in computing]
    assert any(not torch.equal(ref_sel[n].sort(-1).values, exact_sel[n].sort(-1).values) for n in skipped)
    assert not torch.allclose(ref.forward(ids)[0], exact_logits, atol=1e-3)


def test_a_skipping_layer_without_a_selection_is_an_error(tiny_dir):
    model, cfg, _ = load_model(tiny_dir, dtype="float32", progress=False, hf_overrides=reuse(2))
    runner = PagedRunner(model, num_blocks=8)
    runner.step({0: _ids(20, 6)})                          # binds caches; a whole forward works
    layer = model.model.layers[2]
    assert runner.runner.index_caches[2] is None and layer.self_attn.index_cache is None
    x = torch.randn(3, cfg.hidden_size)
    cos, sin = model.model.rotary.cos_sin(torch.arange(3), x.dtype)
    from m3serve.layers.attention_metadata import AttentionMetadata
    meta = AttentionMetadata(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                             torch.tensor([[1]], dtype=torch.int32), torch.tensor([16, 17, 18]), [0, 3], [3], 16)
    for shared in (None, SharedSelection()):
        with pytest.raises(RuntimeError, match="layer 2 reuses the block selection"):
            layer.self_attn(x, cos, sin, meta, shared)


def test_m31_flash_equals_the_reference_that_skips(tiny_m31_dir):
    """All-MSA flavor (5 sparse layers, init block forced): F = 2 with offset 1 runs layers 0, 1, 3."""
    model, cfg, _ = load_model(tiny_m31_dir, dtype="float32", progress=False, hf_overrides=reuse(2, 1))
    assert cfg.index_layer_ids == [0, 1, 3]
    ref = ReferenceM3(cfg, canonical_weights(tiny_m31_dir))
    ours, ref_sel = paged_against_reference(model, ref, torch.tensor(_ids(180, 7)))
    for a, b in zip(ours, ref_sel):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)
    assert torch.equal(ours[2], ours[1]) and torch.equal(ours[4], ours[3])


def test_quantised_checkpoint_equals_exact_below_top_k_blocks(quant_dir):
    """MXFP8 checkpoint (index projections packed inside the fused qkv weight): the skipping
    layer's packed index parts are checked and dropped; up to top-k x block positions every
    visible block is chosen anyway, so the logits equal the exact model's bit for bit."""
    d = quant_dir("mxfp8")
    model, cfg, _ = load_model(d, dtype="float32", progress=False, hf_overrides=reuse(2))
    exact, _, _ = load_model(d, dtype="float32", progress=False)
    skipping = model.attention_layers[2]
    assert not skipping.computes_index and "index_q" not in skipping.qkv_proj.sections
    ids = _ids(cfg.index_topk_blocks * cfg.index_block_size, 8)
    assert torch.equal(PagedRunner(model).step({0: ids}), PagedRunner(exact).step({0: ids}))
