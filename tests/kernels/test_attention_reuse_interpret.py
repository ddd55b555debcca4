"""CPU interpreter test of the attention layer's Triton path with cross-layer top-k reuse: an
indexer layer (fused qk-norm + RoPE + both cache writes, Triton top-k, sparse paged attention)
followed by a layer that skips its indexer (the fused kernel without the index branch, sparse
paged attention over the handed-over selection) equal the CPU path on a ragged decode + chunk
batch whose contexts exceed top-k x block, caches included."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.layers import attention as attention_mod  # noqa: E402
from m3serve.layers import probes  # noqa: E402
from m3serve.layers.attention import SharedSelection  # noqa: E402
from m3serve.layers.attention_metadata import AttentionMetadata  # noqa: E402
from m3serve.model.loader import load_model  # noqa: E402

REUSE = {"text_config": {"use_index_cache": True, "index_topk_freq": 2}}
REQS = [(1, 100), (1, 70), (8, 90)]          # (query tokens, context): contexts > top-4 x 16


def _batch(bs: int, num_pages: int):
    g = torch.Generator().manual_seed(3)
    perm = (1 + torch.randperm(num_pages - 1, generator=g)).tolist()
    width = max(-(-L // bs) for _, L in REQS)
    tables = torch.zeros(len(REQS), width, dtype=torch.int32)
    slots, positions = [], []
    for r, (q, L) in enumerate(REQS):
        n = -(-L // bs)
        tables[r, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
        for p in range(L - q, L):
            positions.append(p)
            slots.append(int(tables[r, p // bs]) * bs + p % bs)
    qsl = [0]
    for q, _ in REQS:
        qsl.append(qsl[-1] + q)
    seq = [L for _, L in REQS]
    meta = AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq, dtype=torch.int32),
                             tables, torch.tensor(slots), qsl, seq, bs)
    return meta, torch.tensor(positions)


def test_skipping_layer_matches_cpu_path(tiny_dir, monkeypatch):
    model, cfg, _ = load_model(tiny_dir, dtype="float32", progress=False, hf_overrides=REUSE)
    layers = [model.model.layers[i].self_attn for i in (1, 2)]
    assert [a.computes_index for a in layers] == [True, False]
    bs, num_pages = cfg.index_block_size, 24
    meta, positions = _batch(bs, num_pages)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(positions.shape[0], cfg.hidden_size, generator=g)            # [T, H]
    cos, sin = model.model.rotary.cos_sin(positions, x.dtype)
    kv = [torch.randn(2, num_pages, bs, a.num_kv_heads, cfg.head_dim, generator=g) for a in layers]
    index = torch.randn(num_pages, bs, cfg.index_head_dim, generator=g)          # the indexer layer's
    original = attention_mod.select

    def run(path: str):
        monkeypatch.setattr(attention_mod, "select",
                            lambda op, t, has_cpu_path=False: path if op == "attention" else original(op, t))
        layers[0].kv_cache, layers[0].index_cache = kv[0].clone(), index.clone()
        layers[1].kv_cache, layers[1].index_cache = kv[1].clone(), None
        shared = SharedSelection()
        with probes.installed(probes.Recorder()) as rec:
            outs = [a(x, cos, sin, meta, shared) for a in layers]
        chosen = rec.tensors(probes.SPARSE_BLOCKS)
        caches = [layers[0].kv_cache, layers[0].index_cache, layers[1].kv_cache]
        return outs, chosen, caches

    want, want_sel, want_caches = run("cpu")
    got, got_sel, got_caches = run("triton")
    assert len(got_sel) == 2 and torch.equal(got_sel[0], got_sel[1])      # the selection handed over
    for a, b in zip(got_sel, want_sel):
        assert torch.equal(a.long().sort(-1).values, b.long().sort(-1).values)
    # the selection matters here: some query leaves a visible block out
    assert (want_sel[0] >= 0).sum(-1).min() < -(-max(L for _, L in REQS) // bs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    for a, b in zip(got_caches, want_caches):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
