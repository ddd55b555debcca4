"""CPU interpreter tests of the Triton MSA indexer at tiny shapes (block 16, top-4, 2 index heads,
Di 32): ragged decode/prefill batches, contexts below and above top-k x block, fp8 cache, both
tile mappings, host-sync freedom of the launchers, an offline sm_90 compile, and the kernel
reference (also the CPU path) against an independent block-by-block oracle."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels import indexer  # noqa: E402
from m3serve.kernels.indexer import index_block_scores, index_topk, select_topk  # noqa: E402
from m3serve.kernels.ref.indexer import index_block_scores_ref, index_topk_ref  # noqa: E402
from test_indexer import (assert_same_sets, assert_scores_match, check_rows,  # noqa: E402
                          make_batch)
from test_rmsnorm import HostSyncGuard, compile_for_hopper  # noqa: E402

TINY = dict(Hi=2, Di=32, block_size=16)
# contexts: below top-k x block (64), exactly at it, and well above (top-k drops blocks)
DECODE = [(1, 150), (1, 40), (1, 64), (1, 1), (1, 97)]
PREFILL = [(20, 150), (5, 5), (33, 70)]


def naive_selection(batch, topk, local, init) -> list[tuple[int, list[int]]]:
    """An oracle written apart from the reference: for each (token, index head) in order, its
    forced blocks (own block, the local - 1 before it, blocks < init, never past its own), then
    the other blocks it can see by descending max of its fp64 dot products with the block's
    visible keys (ties to the lower id), the first topk of them: (number forced, blocks)."""
    iq, cache, tables, bs = batch["iq"], batch["index_cache"], batch["block_tables"], batch["block_size"]
    qsl, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    rows = []
    for r, L in enumerate(lens):
        for t in range(qsl[r], qsl[r + 1]):
            pos = L - (qsl[r + 1] - t)
            own = pos // bs
            forced = [b for b in range(own + 1) if b > own - local or b < init]
            for h in range(iq.shape[1]):
                score = {}
                for b in range(own + 1):
                    if b in forced:
                        continue
                    keys = cache[tables[r, b].long(), :min(bs, pos + 1 - b * bs)].double()
                    score[b] = (keys @ iq[t, h].double()).max().item()
                rows.append((len(forced), (forced + sorted(score, key=lambda b: (-score[b], b)))[:topk]))
    return rows


@pytest.mark.parametrize("local,init", [(1, 0), (2, 1)])
def test_ref_matches_naive_oracle(local, init):
    batch = make_batch(DECODE + PREFILL, **TINY, dtype=torch.float32, device="cpu")
    ours = index_topk_ref(**batch, topk=4, local_blocks=local, init_blocks=init)
    want = naive_selection(batch, 4, local, init)
    got = [[b for b in row if b >= 0] for row in ours.flatten(0, 1).tolist()]
    assert len(got) == len(want)
    # forced blocks tie at +inf, so only the sets must agree; past them the order is the score's
    assert [sorted(g) for g in got] == [sorted(w) for _, w in want]
    assert [g[n:] for g, (n, _) in zip(got, want)] == [w[n:] for n, w in want]
    assert any(len(w) > n for n, w in want)              # rows choose by score too


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


@pytest.mark.parametrize("triton_rows", [True, False], ids=["one-chunk", "multi-chunk"])
def test_select_topk(triton_rows, monkeypatch):
    if not triton_rows:
        monkeypatch.setattr(indexer, "TOPK_CHUNK", 2)
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


@pytest.mark.parametrize("triton_rows", [True, False], ids=["one-chunk", "multi-chunk"])
def test_batch_padding_rows(triton_rows, monkeypatch):
    if not triton_rows:
        monkeypatch.setattr(indexer, "TOPK_CHUNK", 2)
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


def poison_scratch(monkeypatch):
    """Fill the top-k scratch with +inf (and the visible counts with a huge value) before stage 1
    runs: a top-k that read a column stage 1 did not write would select it."""
    real = indexer._index_score_kernel

    class Poisoned:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                args[5].fill_(float("inf"))   # scores
                args[6].fill_(1 << 30)         # nvis
                return real[grid](*args, **kw)
            return launch
    monkeypatch.setattr(indexer, "_index_score_kernel", Poisoned())


# (q_len, seq_len): spec-decode-like short queries, an empty request, one-token requests
SHORT = [(3, 40), (0, 20), (2, 70), (1, 17), (1, 150)]


@pytest.mark.parametrize("max_query_len", [None, 1, 3], ids=["search", "direct-1", "direct-3"])
def test_tile_mappings_and_padding(max_query_len, monkeypatch):
    reqs = DECODE if max_query_len == 1 else SHORT
    batch = make_batch(reqs, **TINY, dtype=torch.float32, device="cpu", seed=4)
    batch["iq"] = torch.cat([batch["iq"], batch["iq"][:2]])      # 2 batch-padding tokens
    batch["max_seq_len"] = 4 * batch["max_seq_len"]              # a graph-style loose bound
    poison_scratch(monkeypatch)
    kw = dict(topk=4, local_blocks=2, init_blocks=1)
    got = index_topk(**batch, max_query_len=max_query_len, **kw)
    real = batch["query_start_loc"][-1].item()
    assert (got[real:] == -1).all()
    ref = index_topk_ref(**dict(batch, iq=batch["iq"][:real]), **kw)
    assert_same_sets(got[:real], ref)
    check_rows(got[:real], batch, 4)


def test_launchers_graph_safe(monkeypatch):
    guard = HostSyncGuard(monkeypatch)
    guard.patch_kernels(monkeypatch, indexer, "_index_score_kernel", "_topk_rows_kernel")
    kw = dict(topk=4, local_blocks=1, init_blocks=1)
    dec = make_batch(DECODE, **TINY, dtype=torch.float32, device="cpu", seed=5)
    got = guard.run(index_topk, **dec, max_query_len=1, **kw)
    # decode: scratch + visible counts + output allocations, one launch per stage, one tile
    # per request (direct mapping)
    assert guard.ops == ["empty", "empty", "empty"] and not guard.views
    assert [n for n, _ in guard.launches] == ["_index_score_kernel", "_topk_rows_kernel"]
    assert guard.launches[0][1][0] == len(DECODE)
    assert_same_sets(got, index_topk_ref(**dec, **kw))
    pre = make_batch(PREFILL, **TINY, dtype=torch.float32, device="cpu", seed=6)
    out = torch.empty(sum(q for q, _ in PREFILL), 2, 4, dtype=torch.int32)
    guard.run(index_topk, **pre, out=out, **kw)                  # prefill: in-kernel tile map
    assert guard.ops == ["empty", "empty"] and len(guard.launches) == 2
    assert_same_sets(out, index_topk_ref(**pre, **kw))
    scores = torch.randn(3, 2, 40)
    ids = guard.run(select_topk, scores, 4)
    assert guard.ops == ["empty"] and len(guard.launches) == 1
    assert torch.equal(ids.long(), scores.topk(4, dim=-1).indices)


def test_compiles_for_hopper(tmp_path):
    score = dict(iq_ptr="*bf16", cache_ptr="*bf16", bt_ptr="*i32", qsl_ptr="*i32",
                 seq_ptr="*i32", score_ptr="*fp32", nvis_ptr="*i32")
    flags = dict(Q_FP8=False, DOT_FP32=False, IEEE=False, EMULATE=False)
    mod = "m3serve.kernels.indexer"
    real = dict(BS=128, DI=128, HP=4)
    topk = dict(score_ptr="*fp32", out_ptr="*i32", ntok_ptr="*i32", nvis_ptr="*i32")
    jobs = [  # real decode (direct, bf16), real prefill (search, fp8 cache), tiny decode
        (mod, "_index_score_kernel", score, dict(real, BLOCK_M=16, TPT=4, TPR=1, R_P=1,
                                                 DIRECT=True, **flags), 4),
        (mod, "_index_score_kernel", dict(score, cache_ptr="*fp8e4nv"),
         dict(real, BLOCK_M=64, TPT=16, TPR=1, R_P=2, DIRECT=False, **dict(flags, Q_FP8=True)),
         4),
        (mod, "_index_score_kernel", score, dict(BS=16, DI=32, HP=2, BLOCK_M=16, TPT=8, TPR=1,
                                                 R_P=1, DIRECT=True, **flags), 4),
        (mod, "_topk_rows_kernel", topk, dict(TOPK=16, TOPK_P=16, CHUNK=64, ONE_CHUNK=True,
                                              HAS_NTOK=True, HAS_NVIS=True), 4),
        (mod, "_topk_rows_kernel", topk, dict(TOPK=16, TOPK_P=16, CHUNK=4096, ONE_CHUNK=False,
                                              HAS_NTOK=True, HAS_NVIS=True), 8),
    ]
    done = compile_for_hopper(jobs, tmp_path)
    assert len(done) == len(jobs)
    assert done[0].endswith("True") and done[1].endswith("True")  # real scoring uses wgmma
