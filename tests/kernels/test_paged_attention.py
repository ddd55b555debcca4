"""GPU tests of the Triton paged attention kernel at real MiniMax-M3 shapes (bf16 and FP8 cache,
dense and MSA sparse, decode / prefill / mixed ragged batches) against its PyTorch reference
(`kernels/ref`, also the CPU path) and an independent token-by-token oracle, plus the case builder
shared with the CPU interpreter tests."""
import math

import pytest
import torch



def make_case(seq_lens, q_lens, *, G, hpg, D, bs, dtype, device, cache_dtype=None, topk=None,
              own_block_prob=1.0, ids_dtype=torch.int32, seed=0):
    """Random ragged batch: (launcher kwargs, dequantized fp32 cache).

    Pages are shuffled so logical != physical; sparse selections are random causal subsets of
    each token's blocks (own block kept with probability own_block_prob, at least one block),
    -1 padded and shuffled.
    """
    gen = torch.Generator().manual_seed(seed)
    R, H = len(seq_lens), G * hpg
    T = sum(q_lens)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    nb = [-(-L // bs) for L in seq_lens]
    num_pages = sum(nb) + 3
    perm = torch.randperm(num_pages, generator=gen)
    tables = torch.zeros(R, max(nb + [1]) + 1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(nb):
        tables[r, :n] = perm[used:used + n].int()
        used += n
    kv = torch.randn(2, num_pages, bs, G, D, generator=gen)
    k_scale = v_scale = None
    if cache_dtype == torch.float8_e4m3fn:
        k_scale, v_scale = torch.tensor([0.05]), torch.tensor([0.02])
        kv = torch.stack([kv[0] / k_scale, kv[1] / v_scale]).to(cache_dtype)
        deq = torch.stack([kv[0].float() * k_scale, kv[1].float() * v_scale])
    else:
        kv = kv.to(dtype)
        deq = kv.float()
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    block_ids = None
    if topk is not None:
        block_ids = torch.full((T, G, topk), -1, dtype=torch.long)
        t = 0
        for r, L in enumerate(seq_lens):
            for i in range(q_lens[r]):
                own = (L - q_lens[r] + i) // bs
                for g in range(G):
                    cand = torch.randperm(own + 1, generator=gen)
                    keep_own = torch.rand(1, generator=gen).item() < own_block_prob or own == 0
                    cand = cand[cand != own]
                    if keep_own:
                        cand = torch.cat([torch.tensor([own]), cand])
                    n = int(torch.randint(1, min(topk, len(cand)) + 1, (1,), generator=gen))
                    slots = torch.randperm(topk, generator=gen)[:n]
                    block_ids[t, g, slots] = cand[:n]
                t += 1
        block_ids = block_ids.to(ids_dtype)
    to = dict(device=device)
    kwargs = dict(
        q=q.to(**to), kv_cache=kv.to(**to),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, **to),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **to), block_tables=tables.to(**to),
        scale=1.0 / math.sqrt(D), block_ids=None if block_ids is None else block_ids.to(**to),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        k_scale=None if k_scale is None else k_scale.to(**to),
        v_scale=None if v_scale is None else v_scale.to(**to))
    return kwargs, deq.to(**to)


def naive_attention(kwargs, deq, key_lo=None):
    """An oracle written apart from the reference: one query token and KV group at a time, the
    keys it may see listed position by position (causal, in a selected block, from key_lo[t]
    on), fp64 over the dequantized cache; a token that sees nothing gets 0. fp32 [T, H, D]."""
    q, ids, tables = kwargs["q"].double(), kwargs["block_ids"], kwargs["block_tables"]
    qsl, lens = kwargs["query_start_loc"].tolist(), kwargs["seq_lens"].tolist()
    T, H, D = q.shape
    bs, G = deq.shape[2], deq.shape[3]
    hpg = H // G
    out = torch.zeros(T, H, D, dtype=torch.float64, device=q.device)
    for r, L in enumerate(lens):
        for t in range(qsl[r], qsl[r + 1]):
            pos = L - (qsl[r + 1] - t)                     # this query's position
            for g in range(G):
                seen = torch.arange(pos + 1, device=q.device)
                if key_lo is not None:
                    seen = seen[seen >= int(key_lo[t])]
                if ids is not None:
                    seen = seen[torch.isin(seen // bs, ids[t, g].long())]
                if seen.numel() == 0:
                    continue
                pages = tables[r, seen // bs].long()
                k = deq[0, pages, seen % bs, g].double()   # [n, D]
                v = deq[1, pages, seen % bs, g].double()
                heads = slice(g * hpg, (g + 1) * hpg)
                w = torch.softmax(q[t, heads] @ k.T * kwargs["scale"], dim=-1)
                out[t, heads] = w @ v
    return out.float()


REAL = dict(G=4, hpg=16, D=128, bs=128)
# decode: contexts below, at and across block / top-k x block (16 x 128 = 2048) boundaries
DECODE_LENS = [1, 127, 128, 129, 2047, 2049, 5000, 9000]
MIXED = ([4000, 300, 50, 129, 2300, 1], [1, 300, 0, 1, 700, 1])


def _check(kwargs, deq, atol, rtol):
    from m3serve.kernels.paged_attention import paged_attention
    from m3serve.kernels.ref.paged_attention import paged_attention_ref
    got = paged_attention(**kwargs)
    ref = paged_attention_ref(**kwargs)
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(ref.float(), naive_attention(kwargs, deq), atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("topk", [None, 16])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_real_shapes(batch, topk, cache_dtype):
    lens = [DECODE_LENS[i % len(DECODE_LENS)] for i in range(batch)]
    kwargs, deq = make_case(lens, [1] * batch, **REAL, dtype=torch.bfloat16, device="cuda",
                            cache_dtype=cache_dtype, topk=topk, seed=batch)
    _check(kwargs, deq, atol=2e-2, rtol=2e-2)  # bf16 output rounding + bf16 P in P@V


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("topk", [None, 16])
def test_mixed_prefill_real_shapes(topk, cache_dtype):
    kwargs, deq = make_case(*MIXED, **REAL, dtype=torch.bfloat16, device="cuda",
                            cache_dtype=cache_dtype, topk=topk, own_block_prob=0.8, seed=7)
    _check(kwargs, deq, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("topk", [None, 16])
@pytest.mark.parametrize("lens", [MIXED, ([8192, 3000, 700], [3000, 3000, 17])])
def test_prefill_tma_and_per_thread_loads(lens, topk, tma, monkeypatch):
    """The prefill kernel with K/V through tensor descriptors (Hopper) and through per-thread
    loads: chunks at the start and in the middle of long contexts (the dense path's unmasked
    tiles and its diagonal), against the reference."""
    from m3serve.kernels import paged_attention as pa
    if tma:
        assert pa.tma_ready(torch.device("cuda")), "this test wants a Hopper GPU"
    monkeypatch.setattr(pa, "_PREFILL_TMA", tma)
    kwargs, deq = make_case(*lens, **REAL, dtype=torch.bfloat16, device="cuda", topk=topk,
                            own_block_prob=0.8, seed=11)
    _check(kwargs, deq, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("topk", [None, 16])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_verify_real_shapes(k, topk, cache_dtype):
    """Speculative verify steps: k + 1 query tokens per request (the token kernel, split-K),
    contexts below and above 2048 = top-k x block."""
    from m3serve.kernels.paged_attention import TOKEN_KERNEL_MAX_QUERY

    lens = [k + 1, 1000, 2047 + k, 3000, 9000, 130]
    assert k + 1 <= TOKEN_KERNEL_MAX_QUERY
    kwargs, deq = make_case(lens, [k + 1] * len(lens), **REAL, dtype=torch.bfloat16, device="cuda",
                            cache_dtype=cache_dtype, topk=topk, seed=10 + k)
    _check(kwargs, deq, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [None, 4])
@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [1, 0, 17, 5]])
def test_tiny_model_shapes_gpu(q_lens, topk):
    kwargs, deq = make_case([1, 70, 40, 200], q_lens, G=2, hpg=2, D=32, bs=16,
                            dtype=torch.bfloat16, device="cuda", topk=topk, seed=3)
    _check(kwargs, deq, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_out_buffer_and_split_path_gpu():
    from m3serve.kernels import paged_attention as pa
    kwargs, deq = make_case([9000], [1], **REAL, dtype=torch.bfloat16, device="cuda", seed=5)
    assert pa._num_splits(4, 9000 // pa._DECODE_BLOCK_N, pa._DECODE_BLOCK_N,
                          torch.device("cuda"), pa._MIN_KEYS_PER_SPLIT) > 1  # batch 1 takes split-K
    out = torch.empty_like(kwargs["q"])
    got = pa.paged_attention(**kwargs, out=out)
    assert got is out
    torch.testing.assert_close(out.float(), naive_attention(kwargs, deq), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("topk", [None, 16])
@pytest.mark.parametrize("batch,q_len", [(1, 1), (8, 1), (64, 1), (16, 4)])
def test_split_merge_in_kernel_gpu(batch, q_len, topk, cache_dtype, monkeypatch):
    """M3SERVE_SPLIT_MERGE_IN_KERNEL at the real shapes (decode and verify rows): equal to the
    reference and to the separate merge within bf16 rounding, also replayed 20 times in a CUDA
    graph (the hand-off between the programs of one token under real concurrency), the
    counters back to zero after each launch."""
    from m3serve import envs
    from m3serve.kernels import paged_attention as pa
    from m3serve.kernels.ref.paged_attention import paged_attention_ref
    lens = [max(q_len, DECODE_LENS[i % len(DECODE_LENS)]) for i in range(batch)]
    kwargs, deq = make_case(lens, [q_len] * batch, **REAL, dtype=torch.bfloat16, device="cuda",
                            cache_dtype=cache_dtype, topk=topk, seed=batch + q_len)
    separate = pa.paged_attention(**kwargs)
    monkeypatch.setattr(envs, "SPLIT_MERGE_IN_KERNEL", True)
    out = pa.paged_attention(**kwargs)
    ref = paged_attention_ref(**kwargs)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), separate.float(), atol=2e-2, rtol=2e-2)
    counters = pa._COUNTERS.get(torch.device("cuda", torch.cuda.current_device()))
    if counters is None:                  # one split everywhere (a one-token context): no merge
        counters = torch.zeros(1, dtype=torch.int32, device="cuda")
    assert not counters.any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = pa.paged_attention(**kwargs)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out) and not counters.any()
