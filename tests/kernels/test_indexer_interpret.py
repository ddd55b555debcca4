"""CPU interpreter tests of the Triton MSA indexer at tiny shapes (block 16, top-4, 2 index heads,
Di 32): ragged decode/prefill batches, contexts below and above top-k x block, fp8 cache, and the
kernel reference against the layer op `index_topk_ref` in m3serve.layers.indexer."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels import indexer  # noqa: E402
from m3serve.kernels.indexer import index_block_scores, index_topk, select_topk  # noqa: E402
from m3serve.kernels.ref.indexer import index_block_scores_ref, index_topk_ref  # noqa: E402
from m3serve.layers.attention_metadata import AttentionMetadata  # noqa: E402
from m3serve.layers.indexer import index_topk_ref as layer_index_topk  # noqa: E402
from test_indexer import (assert_same_sets, assert_scores_match, check_rows,  # noqa: E402
                          make_batch)

TINY = dict(Hi=2, Di=32, block_size=16)
# contexts: below top-k x block (64), exactly at it, and well above (top-k drops blocks)
DECODE = [(1, 150), (1, 40), (1, 64), (1, 1), (1, 97)]
PREFILL = [(20, 150), (5, 5), (33, 70)]


def layer_meta(batch) -> AttentionMetadata:
    qsl, lens = batch["query_start_loc"], batch["seq_lens"]
    return AttentionMetadata(query_start_loc=qsl, seq_lens=lens, block_tables=batch["block_tables"],
                             slot_mapping=torch.zeros(0, dtype=torch.long),
                             query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=lens.tolist(),
                             block_size=batch["block_size"])


@pytest.mark.parametrize("local,init", [(1, 0), (2, 1)])
def test_ref_matches_layer_op(local, init):
    batch = make_batch(DECODE + PREFILL, **TINY, dtype=torch.float32, device="cpu")
    ours = index_topk_ref(**batch, topk=4, local_blocks=local, init_blocks=init)
    theirs = layer_index_topk(batch["iq"], batch["index_cache"], layer_meta(batch), 4, local, init)
    assert_same_sets(ours, theirs)  # forced blocks tie at +inf, so only the sets must agree
    if local == 1 and init == 0:  # one forced block: no ties, so the row order agrees too
        assert torch.equal(ours.long(), theirs)


@pytest.mark.parametrize("reqs", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("target", [1024, 3], ids=["1-block-programs", "multi-block-programs"])
def test_kernel_matches_ref(reqs, target, monkeypatch):
    monkeypatch.setattr(indexer, "TARGET_PROGRAMS", target)  # few programs: long block loops
    batch = make_batch(reqs, **TINY, dtype=torch.float32, device="cpu", seed=1)
    kw = dict(local_blocks=1, init_blocks=1)
    assert_scores_match(index_block_scores(**batch, **kw), index_block_scores_ref(**batch, **kw),
                        atol=1e-4)
    got = index_topk(**batch, topk=4, **kw)
    ref = index_topk_ref(**batch, topk=4, **kw)
    assert got.dtype == torch.int32
    assert_same_sets(got, ref)
    check_rows(got, batch, 4)
    assert (got == -1).any() and (ref[:, :, 0] >= 0).all()  # padding exercised, rows never empty


@pytest.mark.parametrize("triton_rows", [True, False], ids=["triton-topk", "torch-topk"])
def test_select_topk(triton_rows, monkeypatch):
    if not triton_rows:
        monkeypatch.setattr(indexer, "MAX_TRITON_TOPK_ROW", 0)
    inf = float("inf")
    scores = torch.tensor([[[2.0, inf, 5.0, -inf, 5.0, 1.0]],      # tie at 5.0, forced block 1
                           [[-inf, 3.0, -inf, -inf, -inf, -inf]]])  # one valid block
    got = select_topk(scores, 4)
    assert got[0, 0, 0] == 1                                        # forced first
    if triton_rows:
        assert got[0, 0, 1] == 2                                    # tie -> lower id
    assert sorted(got[0, 0].tolist()) == [0, 1, 2, 4]
    assert got[1, 0].tolist() == [1, -1, -1, -1]
    wide = select_topk(scores[:, :, :3], 5)                         # topk > columns: -1 padded
    assert sorted(wide[0, 0].tolist()) == [-1, -1, 0, 1, 2]


def test_block_scores_masking():
    # one request, 3 query tokens at positions 37..39 of a 40-token context (3 blocks of 16)
    batch = make_batch([(3, 40)], **TINY, dtype=torch.float32, device="cpu", seed=2)
    batch["max_seq_len"] = 80  # wider scratch: blocks 3, 4 are past every token
    s = index_block_scores(**batch, local_blocks=1)
    assert s.shape == (3, 2, 5)
    assert torch.isinf(s[:, :, 2]).all() and (s[:, :, 2] > 0).all()   # own block forced
    assert (s[:, :, 3:] == -float("inf")).all()
    keys = batch["index_cache"][batch["block_tables"][0, 1].long()]    # block 1, all visible
    want = torch.einsum("thd,kd->thk", batch["iq"], keys).amax(-1)
    torch.testing.assert_close(s[:, :, 1], want, atol=1e-5, rtol=1e-5)


def test_fp8_cache():
    batch = make_batch(DECODE[:3] + PREFILL[:1], **TINY, dtype=torch.bfloat16, device="cpu",
                       cache_dtype=torch.float8_e4m3fn, seed=3)
    kw = dict(topk=4, local_blocks=1)
    assert_same_sets(index_topk(**batch, **kw), index_topk_ref(**batch, **kw))


@pytest.mark.parametrize("triton_rows", [True, False], ids=["triton-topk", "torch-topk"])
def test_batch_padding_rows(triton_rows, monkeypatch):
    if not triton_rows:
        monkeypatch.setattr(indexer, "MAX_TRITON_TOPK_ROW", 0)
    batch = make_batch(DECODE[:2], **TINY, dtype=torch.float32, device="cpu")
    batch["iq"] = torch.cat([batch["iq"], batch["iq"]])  # 2 padding tokens past qsl[-1]
    got = index_topk(**batch, topk=4, local_blocks=1)
    assert (got[2:] == -1).all() and (got[:2, :, 0] >= 0).all()


def test_out_buffer_and_bad_input():
    batch = make_batch(DECODE[:2], **TINY, dtype=torch.float32, device="cpu")
    out = torch.zeros(2, 2, 4, dtype=torch.int32)
    res = index_topk(**batch, topk=4, local_blocks=1, out=out)
    assert res is out and (out[:, :, 0] >= 0).all()
    with pytest.raises(ValueError, match="max_seq_len"):
        index_topk(**dict(batch, max_seq_len=0), topk=4, local_blocks=1)
    with pytest.raises(ValueError, match="index_cache"):
        index_topk(**dict(batch, index_cache=batch["index_cache"][:, :8]), topk=4, local_blocks=1)
