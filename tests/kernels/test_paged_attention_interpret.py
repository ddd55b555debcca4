"""CPU interpreter tests of the Triton paged attention kernel at tiny ragged shapes (dense and
sparse, decode / split-K / prefill / mixed, fp32 / fp16 / FP8 cache), and of its PyTorch
reference (the CPU path) against an independent token-by-token oracle."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels import paged_attention as pa  # noqa: E402
from m3serve.kernels.ref.paged_attention import paged_attention_ref  # noqa: E402
from test_paged_attention import make_case, naive_attention  # noqa: E402

TINY = dict(G=2, hpg=2, D=32, bs=16)
FP32_TOL = dict(atol=2e-5, rtol=1e-4)


def _run(kwargs):
    got = pa.paged_attention(**kwargs)
    ref = paged_attention_ref(**kwargs)
    return got, ref


@pytest.fixture
def force_split(monkeypatch):
    """Tiny contexts only split-K when a split may be one 16-key tile."""
    monkeypatch.setattr(pa, "_MIN_KEYS_PER_SPLIT", 16)
    monkeypatch.setattr(pa, "_MIN_KEYS_PER_SPLIT_SPARSE", 16)


@pytest.mark.parametrize("topk", [None, 4])
def test_ref_matches_naive_oracle(topk):
    # contexts shorter and longer than topk x block (64), chunked prefill, empty request
    kwargs, deq = make_case([1, 37, 200, 90, 12], [1, 5, 40, 0, 12], **TINY,
                            dtype=torch.float32, device="cpu", topk=topk, seed=1)
    ref = paged_attention_ref(**kwargs)
    torch.testing.assert_close(ref, naive_attention(kwargs, deq), **FP32_TOL)
    if topk is not None:  # the selection really changes the result
        dense = paged_attention_ref(**{**kwargs, "block_ids": None})
        assert (dense - ref).abs().max() > 1e-2


def _positions(kwargs) -> torch.Tensor:
    """Each query token's position [T]."""
    qsl, lens = kwargs["query_start_loc"].tolist(), kwargs["seq_lens"].tolist()
    return torch.tensor([L - (qsl[r + 1] - t) for r, L in enumerate(lens) for t in range(qsl[r], qsl[r + 1])])


@pytest.mark.parametrize("topk", [None, 4])
def test_ref_left_edge(topk):
    """key_lo: token t sees only keys at positions >= key_lo[t] (a sliding window of W is
    key_lo = position - W + 1), in prefill-sized batches too."""
    kwargs, deq = make_case([1, 37, 200, 90], [1, 5, 40, 90], **TINY, dtype=torch.float32,
                            device="cpu", topk=topk, seed=11)
    pos = _positions(kwargs)
    for window in (3, 17, 40):
        key_lo = (pos - window + 1).clamp_min(0)
        torch.testing.assert_close(paged_attention_ref(**kwargs, key_lo=key_lo),
                                   naive_attention(kwargs, deq, key_lo=key_lo), **FP32_TOL)
    cut = paged_attention_ref(**kwargs, key_lo=(pos - 16).clamp_min(0))
    assert (cut - paged_attention_ref(**kwargs)).abs().max() > 1e-2
    if topk is None:  # a window of 1: each query sees only its own key, so it returns its own value
        got = paged_attention_ref(**kwargs, key_lo=pos)
        qsl, tables, bs, hpg = kwargs["query_start_loc"].tolist(), kwargs["block_tables"], TINY["bs"], TINY["hpg"]
        for t, p in enumerate(pos.tolist()):
            r = max(i for i in range(len(qsl) - 1) if qsl[i] <= t)
            own_v = deq[1, tables[r, p // bs], p % bs]                        # [G, D]
            torch.testing.assert_close(got[t], own_v.repeat_interleave(hpg, 0), **FP32_TOL)


def test_dense_decode_split_k(force_split):
    kwargs, deq = make_case([1, 37, 70], [1, 1, 1], **TINY, dtype=torch.float32,
                            device="cpu", seed=2)
    # the split + merge path runs
    assert pa._num_splits(3 * 2, 5, 16, torch.device("cpu"), pa._MIN_KEYS_PER_SPLIT) == 4
    got, ref = _run(kwargs)
    torch.testing.assert_close(got, ref, **FP32_TOL)
    torch.testing.assert_close(got, naive_attention(kwargs, deq), **FP32_TOL)


def test_dense_decode_single_split_fp16_out_buffer():
    kwargs, deq = make_case([20, 33], [1, 1], **TINY, dtype=torch.float16, device="cpu", seed=3)
    out = torch.full_like(kwargs["q"], float("nan"))
    got = pa.paged_attention(**kwargs, out=out)
    assert got is out
    torch.testing.assert_close(got, paged_attention_ref(**kwargs), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("block_m", [128, 16])
def test_dense_mixed_prefill_batch(monkeypatch, block_m):
    # decode, full prefill, chunked prefill over earlier context, empty request, in one call;
    # block_m 16 = 8-token query tiles, so requests span several tiles
    monkeypatch.setitem(pa._PREFILL_TILES, (False, False), (block_m, 64, 4, 2))
    kwargs, deq = make_case([40, 20, 50, 10], [1, 20, 9, 0], **TINY, dtype=torch.float32,
                            device="cpu", seed=4)
    got, ref = _run(kwargs)
    torch.testing.assert_close(got, ref, **FP32_TOL)
    torch.testing.assert_close(got, naive_attention(kwargs, deq), **FP32_TOL)


@pytest.mark.parametrize("q_lens,tiled,ids_dtype", [
    ([1, 1, 1, 0], True, torch.int32),      # pure decode: per-token split-K kernel
    ([1, 1, 4, 30], True, torch.int64),     # mixed: query tiles over the union of blocks
    ([1, 1, 4, 30], False, torch.int32),    # mixed: per-token programs
    ([0, 30, 0, 9], True, torch.int32),     # empty requests first and between: tile numbering
])
def test_sparse_batches(force_split, monkeypatch, q_lens, tiled, ids_dtype):
    # contexts longer (100, 90, 70) and shorter (30) than topk x block; own block sometimes
    # unselected; 8-token query tiles so the 30-token request spans four tiles
    monkeypatch.setattr(pa, "_SPARSE_PREFILL_TILED", tiled)
    monkeypatch.setitem(pa._PREFILL_TILES, (True, False), (16, 64, 4, 3))
    kwargs, deq = make_case([100, 30, 90, 70], q_lens, **TINY, dtype=torch.float32,
                            device="cpu", topk=4, own_block_prob=0.7, ids_dtype=ids_dtype,
                            seed=5)
    assert (kwargs["block_ids"] == -1).any()
    got, ref = _run(kwargs)
    torch.testing.assert_close(got, ref, **FP32_TOL)
    torch.testing.assert_close(got, naive_attention(kwargs, deq), **FP32_TOL)


@pytest.mark.parametrize("topk", [None, 4])
def test_prefill_through_tensor_descriptors(monkeypatch, topk):
    """The Hopper path forced on under the interpreter: K/V tiles through tensor descriptors,
    the dense key tiles before a query tile unmasked (8-token tiles, 16-key tiles: chunks with
    earlier context have many such tiles), the sparse union in one loop; a decode, a full
    prefill, a chunk over earlier context and an empty request in one call."""
    monkeypatch.setattr(pa, "tma_ready", lambda device: True)
    monkeypatch.setitem(pa._PREFILL_TILES, (topk is not None, True), (16, 16, 4, 2))
    kwargs, deq = make_case([40, 20, 75, 10], [1, 20, 9, 0], **TINY, dtype=torch.float32,
                            device="cpu", topk=topk, own_block_prob=0.7, seed=12)
    got, ref = _run(kwargs)
    torch.testing.assert_close(got, ref, **FP32_TOL)
    torch.testing.assert_close(got, naive_attention(kwargs, deq), **FP32_TOL)


@pytest.mark.parametrize("topk", [None, 4])
def test_fp8_cache(topk):
    kwargs, deq = make_case([45, 70], [1, 3], **TINY, dtype=torch.float32, device="cpu",
                            cache_dtype=torch.float8_e4m3fn, topk=topk, seed=6)
    got, ref = _run(kwargs)
    torch.testing.assert_close(got, ref, **FP32_TOL)
    torch.testing.assert_close(got, naive_attention(kwargs, deq), **FP32_TOL)


@pytest.mark.parametrize("q_lens", [[1, 1], [1, 3]])
def test_real_head_layout_g4_d128(q_lens):
    # 16 heads per group as M, head_dim 128, page 128 split into two 64-key tiles
    kwargs, deq = make_case([200, 130], q_lens, G=4, hpg=16, D=128, bs=128,
                            dtype=torch.float32, device="cpu", seed=8)
    got, ref = _run(kwargs)
    torch.testing.assert_close(got, ref, **FP32_TOL)
    torch.testing.assert_close(got, naive_attention(kwargs, deq), **FP32_TOL)


def test_token_without_visible_keys_gets_zero():
    kwargs, _ = make_case([40], [1], **TINY, dtype=torch.float32, device="cpu", topk=2, seed=9)
    kwargs["block_ids"][0, 0] = torch.tensor([-1, 7])  # block 7 is past the token: nothing visible
    got, ref = _run(kwargs)
    assert torch.equal(got[0, :2], torch.zeros(2, 32)) and torch.equal(ref[0, :2], torch.zeros(2, 32))
    torch.testing.assert_close(got, ref, **FP32_TOL)
    assert got[0, 2:].abs().sum() > 0


def _tiny_kwargs():
    return make_case([20], [1], **TINY, dtype=torch.float32, device="cpu", seed=10)[0]


@pytest.mark.parametrize("field,value,match", [
    ("q", torch.zeros(1, 3, 32), "multiple of num_kv_heads"),
    ("kv_cache", torch.zeros(2, 4, 12, 2, 32), "block_size"),
    ("kv_cache", torch.zeros(2, 4, 16, 2, 32, dtype=torch.float16), "dtype"),
    ("block_ids", torch.zeros(1, 3, 4, dtype=torch.int32), "block_ids"),
    ("query_start_loc", torch.zeros(3, dtype=torch.int32), "query_start_loc"),
    ("out", torch.zeros(1, 4, 16), "out"),
])
def test_bad_input_raises(field, value, match):
    kwargs = _tiny_kwargs()
    kwargs[field] = value
    with pytest.raises(ValueError, match=match):
        pa.paged_attention(**kwargs)


def test_fp8_without_scales_raises():
    kwargs = _tiny_kwargs()
    kwargs["kv_cache"] = kwargs["kv_cache"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        pa.paged_attention(**kwargs)


def test_prefill_kernel_compiles_for_hopper(tmp_path):
    """The prefill kernel compiles for sm_90 with the bundled ptxas, dense and sparse, with K/V
    through tensor descriptors (TMA) and through per-thread loads, at the real head layout; the
    tiles run on wgmma either way."""
    from test_rmsnorm import compile_for_hopper
    ptr = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
           "query_start_loc": "*i32", "seq_lens": "*i32", "block_tables": "*i32",
           "block_ids_ptr": "*i32", "union_ptr": "*i32", "union_count_ptr": "*i32",
           "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "qk_scale": "fp32"}
    jobs = [["m3serve.kernels.paged_attention", "_prefill_kernel", ptr,
             {"HPG": 16, "HPG_PAD": 16, "BLOCK_Q": 4, "D": 128, "BLOCK_SIZE": 128, "BLOCK_N": 64,
              "TOPK_PAD": 16, "SPARSE": sparse, "FP8": False, "TMA": tma, "G": 4}, 4]
            for sparse in (False, True) for tma in (False, True)]
    lines = compile_for_hopper(jobs, tmp_path)
    assert len(lines) == 4 and all(line.endswith("True") for line in lines)


@pytest.mark.parametrize("topk", [None, 4])
def test_per_token_left_edge(topk, force_split):
    """key_lo (DSpark's sliding window): token t sees keys key_lo[t] .. its position, dense and
    inside selected blocks, across split-K; a left edge past some keys really changes them."""
    kwargs, deq = make_case([9, 70, 70, 150], [1, 1, 1, 1], **TINY, dtype=torch.float32,
                            device="cpu", topk=topk, seed=7)
    key_lo = torch.tensor([0, 40, 69, 100])
    got = pa.paged_attention(**kwargs, key_lo=key_lo)
    torch.testing.assert_close(got, paged_attention_ref(**kwargs, key_lo=key_lo), **FP32_TOL)
    torch.testing.assert_close(got, naive_attention(kwargs, deq, key_lo=key_lo), **FP32_TOL)
    full = pa.paged_attention(**kwargs)
    assert (full[1:] - got[1:]).abs().amax(dim=(1, 2)).min() > 1e-3 or topk is not None
    assert torch.equal(full[0], got[0])                     # key_lo 0 cuts nothing


@pytest.mark.parametrize("sparse,key_lo", [(False, False), (True, False), (True, True)])
def test_warm_up_runs_every_split_count(sparse, key_lo):
    """The start-up warm-up's calls (`warm_up_token_kernel`: one query on the null page, each
    forced split count up to the maximum) run on the configurations the engine uses."""
    calls = []
    real = pa.paged_attention

    def counting(*args, **kwargs):
        calls.append(kwargs["num_splits"])
        return real(*args, **kwargs)
    cache = torch.zeros(2, 3, 16, 2, 32)
    pa.paged_attention = counting
    try:
        pa.warm_up_token_kernel(4, cache, torch.float32, sparse=sparse, key_lo=key_lo)
    finally:
        pa.paged_attention = real
    assert calls == [1, 2, 4, 8, 16, 32, 64]


class _NoMergeKernel:
    def __getitem__(self, grid):
        raise AssertionError("the separate merge kernel ran")


@pytest.mark.parametrize("topk,q_lens", [(None, [1, 1, 1]), (4, [1, 1, 1]), (4, [2, 3, 1]), (None, [4, 4, 4])])
def test_split_merge_in_kernel(force_split, monkeypatch, topk, q_lens):
    """M3SERVE_SPLIT_MERGE_IN_KERNEL: the program of a (token, KV group) that finishes last
    merges its splits (no merge kernel), equal to the reference and nearly to the separate
    merge (which sums the splits as a tree); its counters are back to zero after each launch."""
    from m3serve import envs
    kwargs, deq = make_case([40, 70, 100], q_lens, **TINY, dtype=torch.float32, device="cpu",
                            topk=topk, seed=13)
    separate = pa.paged_attention(**kwargs)
    monkeypatch.setattr(envs, "SPLIT_MERGE_IN_KERNEL", True)
    monkeypatch.setattr(pa, "_merge_splits_kernel", _NoMergeKernel())
    T = kwargs["q"].shape[0]
    assert pa._num_splits(T * TINY["G"], 100 // 16 + 1, 16, torch.device("cpu"), 16) > 1
    for _ in range(2):
        got = pa.paged_attention(**kwargs)
        torch.testing.assert_close(got, paged_attention_ref(**kwargs), **FP32_TOL)
        torch.testing.assert_close(got, separate, **FP32_TOL)
        assert not pa._COUNTERS[torch.device("cpu")].any()
    torch.testing.assert_close(got, naive_attention(kwargs, deq), **FP32_TOL)


def test_token_kernel_compiles_for_hopper(tmp_path):
    """The per-token kernel compiles for sm_90 at the real head layout (16 heads a group, D 128,
    blocks of 128), with the separate merge and with the merge in the kernel, dense and sparse."""
    from test_rmsnorm import compile_for_hopper
    ptr = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
           "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "counter_ptr": "*i32",
           "query_start_loc": "*i32", "seq_lens": "*i32", "block_tables": "*i32",
           "block_ids_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
           "key_lo_ptr": "*i32", "qk_scale": "fp32"}
    jobs = [["m3serve.kernels.paged_attention", "_token_attn_kernel", ptr,
             {"HPG": 16, "BLOCK_H": 16, "D": 128, "BLOCK_SIZE": 128, "BLOCK_N": 64, "NUM_SPLITS": 8,
              "SPARSE": sparse, "FP8": False, "HAS_LO": False, "MERGE": merge}, 4]
            for sparse in (False, True) for merge in (False, True)]
    assert len(compile_for_hopper(jobs, tmp_path)) == 4
