"""GPU tests of the Triton MSA indexer at real M3 shapes (decode up to 128K context, prefill
chunks, bf16 and fp8 index caches), plus the ragged-batch builders shared with the CPU
interpreter tests. Selections are compared as SETS per (token, head): row order is not part of
the contract and exact fp32 ties are rare with random data."""
import pytest
import torch


def make_batch(reqs, *, Hi, Di, block_size, dtype, device, cache_dtype=None, seed=0):
    """reqs: [(q_len, seq_len)]. Returns kwargs for index_topk (minus topk/local/init) with a
    shuffled page pool, so logical != physical block ids."""
    g = torch.Generator().manual_seed(seed)
    T = sum(q for q, _ in reqs)
    nbs = [-(-L // block_size) for _, L in reqs]
    width = max(nbs) + 1
    num_pages = sum(nbs) + 3
    perm = torch.randperm(num_pages, generator=g)
    bt = torch.zeros(len(reqs), width, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(nbs):
        bt[r, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    cache = torch.randn(num_pages, block_size, Di, generator=g).to(cache_dtype or dtype)
    iq = torch.randn(T, Hi, Di, generator=g).to(dtype)
    qsl = torch.tensor([0] + [q for q, _ in reqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    seq = torch.tensor([L for _, L in reqs], dtype=torch.int32)
    return dict(iq=iq.to(device), index_cache=cache.to(device), query_start_loc=qsl.to(device),
                seq_lens=seq.to(device), block_tables=bt.to(device), block_size=block_size,
                max_seq_len=max(L for _, L in reqs))


def as_sets(ids: torch.Tensor) -> torch.Tensor:
    """Sort each row so that selections compare as sets (-1 padding sorts first)."""
    return ids.long().sort(-1).values.cpu()


def assert_same_sets(a, b, scores=None, atol=0.0):
    """Rows must select the same block sets; with `scores` [T, Hi, blocks], a differing row is
    accepted when both selections carry the same sorted scores (a tie, or a near-tie within
    atol of the fp32 summation order)."""
    diff = (as_sets(a) != as_sets(b)).any(-1)                                # [T, Hi]
    if scores is None or not diff.any():
        assert not diff.any(), f"{diff.sum().item()} rows differ"
        return
    s = scores.cpu()
    for t, h in diff.nonzero().tolist():
        va = s[t, h, a[t, h].long().cpu().clamp_min(0)].masked_fill(a[t, h].cpu() < 0, -1e30)
        vb = s[t, h, b[t, h].long().cpu().clamp_min(0)].masked_fill(b[t, h].cpu() < 0, -1e30)
        torch.testing.assert_close(va.sort().values, vb.sort().values, atol=atol, rtol=0)


def assert_scores_match(got, want, atol):
    """Block scores: identical +inf/-inf pattern, finite values within atol."""
    assert torch.equal(torch.isinf(got) & (got > 0), torch.isinf(want) & (want > 0))
    assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(want) & (want < 0))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=atol, rtol=0)


def check_rows(ids, batch, topk):
    """Contract checks independent of scores: no duplicates, -1 only as padding count, own
    block always selected, every id a valid logical block of its token."""
    bs = batch["block_size"]
    ids = ids.cpu()
    qsl, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    for r, L in enumerate(lens):
        q_len = qsl[r + 1] - qsl[r]
        for i in range(q_len):
            p = L - q_len + i
            row = ids[qsl[r] + i].long()                                    # [Hi, topk]
            n_valid = min(topk, p // bs + 1)
            assert ((row >= 0).sum(-1) == n_valid).all()
            assert (row <= p // bs).all()
            assert ((row == p // bs).sum(-1) == 1).all()
            for h in range(row.shape[0]):
                sel = row[h][row[h] >= 0]
                assert sel.unique().numel() == sel.numel()


DECODE = [(1, 8192), (1, 5000), (1, 130), (1, 2048), (1, 131072), (1, 1)]
VERIFY = [(4, 8192), (4, 1000), (4, 2051), (4, 4), (4, 30000), (4, 129)]      # k = 3 drafts
PREFILL = [(1000, 9000), (2048, 2048), (1, 300), (517, 40000)]


@pytest.mark.gpu
@pytest.mark.parametrize("reqs", [DECODE, PREFILL, DECODE[:3] + PREFILL[:2], VERIFY],
                         ids=["decode", "prefill", "mixed", "verify"])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("block_size", [128, 16])
@pytest.mark.parametrize("give_max_query_len", [False, True], ids=["search-map", "direct-map"])
def test_index_topk_gpu(reqs, cache, block_size, give_max_query_len):
    from m3serve.kernels.indexer import index_block_scores, index_topk
    from m3serve.kernels.ref.indexer import index_block_scores_ref, index_topk_ref
    if block_size == 16:
        reqs = [(q, min(L, 20000)) for q, L in reqs]
    batch = make_batch(reqs, Hi=4, Di=128, block_size=block_size, dtype=torch.bfloat16,
                       device="cuda",
                       cache_dtype=torch.float8_e4m3fn if cache == "fp8" else None)
    kw = dict(local_blocks=1, init_blocks=1)
    mq = max(q for q, _ in reqs) if give_max_query_len else None
    got = index_topk(**batch, topk=16, max_query_len=mq, **kw)
    ref = index_topk_ref(**batch, topk=16, **kw)
    assert got.dtype == torch.int32 and got.shape == ref.shape
    ref_scores = index_block_scores_ref(**batch, **kw)
    # recorded tolerance: bf16 -> fp32 sums of 128 exact products in another order (|score| <~
    # 60); fp8 -> Hopper's e4m3 MMA accumulates with reduced precision, so allow 5e-2
    atol = 5e-2 if cache == "fp8" else 1e-3
    assert_scores_match(index_block_scores(**batch, **kw), ref_scores, atol=atol)
    assert_same_sets(got, ref, scores=ref_scores, atol=atol)
    check_rows(got, batch, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_index_topk_cuda_graph(cache):
    """Captured once with a loose max_seq_len (like the engine's decode graphs), replayed on new
    contexts written into the same buffers: capture fails on any host sync, and the replay
    must follow the new seq_lens."""
    from m3serve.kernels.indexer import index_topk
    from m3serve.kernels.ref.indexer import index_block_scores_ref, index_topk_ref
    cdt = torch.float8_e4m3fn if cache == "fp8" else None
    first = make_batch([(1, 300), (1, 5000), (1, 1), (1, 9000)], Hi=4, Di=128, block_size=128,
                       dtype=torch.bfloat16, device="cuda", cache_dtype=cdt, seed=1)
    second = make_batch([(1, 20000), (1, 129), (1, 7000), (1, 64)], Hi=4, Di=128,
                        block_size=128, dtype=torch.bfloat16, device="cuda", cache_dtype=cdt,
                        seed=2)
    static = dict(first, max_seq_len=32768, block_tables=torch.zeros(
        4, 32768 // 128, dtype=torch.int32, device="cuda"),
        index_cache=torch.zeros(max(first["index_cache"].shape[0],
                                    second["index_cache"].shape[0]), 128, 128,
                                dtype=first["index_cache"].dtype, device="cuda"))
    kw = dict(topk=16, local_blocks=1, init_blocks=1, max_query_len=1)

    def load(b):
        for name in ("iq", "query_start_loc", "seq_lens"):
            static[name].copy_(b[name])
        static["block_tables"].zero_()
        static["block_tables"][:, :b["block_tables"].shape[1]].copy_(b["block_tables"])
        static["index_cache"][:b["index_cache"].shape[0]].copy_(b["index_cache"])
    load(first)
    index_topk(**static, **kw)                                   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = index_topk(**static, **kw)
    for b in (first, second):
        load(b)
        graph.replay()
        torch.cuda.synchronize()
        ref_kw = dict(b, max_seq_len=static["max_seq_len"], block_tables=static["block_tables"],
                      index_cache=static["index_cache"])
        ref_scores = index_block_scores_ref(**ref_kw, local_blocks=1, init_blocks=1)
        ref = index_topk_ref(**ref_kw, topk=16, local_blocks=1, init_blocks=1)
        atol = 5e-2 if cache == "fp8" else 1e-3
        assert_same_sets(got, ref, scores=ref_scores, atol=atol)
        check_rows(got, b, 16)
