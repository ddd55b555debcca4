"""Fused MoE under the Triton interpreter (CPU, tiny shapes: H=64, I=32, E=8): routing, alignment,
kernel == fused_moe_ref == the lead's layer ops, bf16-free dtypes (fp32/fp16) and FP8 weights."""
import itertools
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run only without a GPU", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from launches import record_launches  # noqa: E402
from m3serve.kernels import fused_moe as fm
from m3serve.kernels.fused_moe import fused_moe, moe_align, moe_route, quant_rows_fp8
from m3serve.kernels.ref.fused_moe import (
    fused_moe_ref,
    moe_align_ref,
    quant_rows_fp8_ref,
    quant_weight_fp8,
)
from m3serve.layers.activation import swiglu_oai_ref as swiglu_oai
from m3serve.layers.moe import experts_ref, route

H, I, E = 64, 32, 8
ALPHA, LIMIT = 1.702, 7.0


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weights(seed, inter=I, inter_shared=I, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # 0.3 keeps gate/up around +-3, so both clamps at 7 are exercised by the larger rows.
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.3).to(dtype)
    shared = ((torch.randn(2 * inter_shared, H, generator=g) * 0.3).to(dtype),
              (torch.randn(H, inter_shared, generator=g) * 0.3).to(dtype))
    return w13, w2, shared


def _routing(seed, num_tokens, top_k, experts=E, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_tokens, H, generator=g) * 1.5).to(dtype)
    gate = torch.randn(experts, H, generator=g)
    bias = torch.randn(experts, generator=g) * 0.1
    weights, ids = moe_route(x, gate, bias, top_k, 2.0)
    return x, weights, ids


def _shared_mlp(x, shared):
    """The lead's DenseMLP math: down(swiglu_oai(gate_up(x)))."""
    return swiglu_oai(x @ shared[0].t(), ALPHA, LIMIT) @ shared[1].t()


@pytest.mark.parametrize("num_tokens", [1, 17])
def test_route_matches_layer_route(num_tokens):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16)
    gate, bias = torch.randn(E, H, generator=g), torch.randn(E, generator=g)
    weights, ids = moe_route(x, gate, bias, 4, 2.0)
    ref_w, ref_ids = route(x, gate, bias, 4, 2.0)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w)
    torch.testing.assert_close(weights.sum(-1), torch.full((num_tokens,), 2.0))


def _route_matches_layer_route(num_tokens, hidden, experts, top_k):
    """moe_route at router logits of order 1, as a trained model has them: the layer's torch
    route's experts, and its weights to fp32 rounding."""
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    gate = torch.randn(experts, hidden, generator=g) * hidden ** -0.5
    bias = torch.randn(experts, generator=g) * 0.05
    weights, ids = moe_route(x, gate, bias, top_k, 2.5)
    ref_w, ref_ids = route(x, gate, bias, top_k, 2.5)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [2, 29])
def test_fused_route_kernels_match_reference_at_trained_scale(num_tokens):
    """The two routing kernels (split-hidden partial logits, then sum, sigmoid and top-k)
    against the layer's torch route."""
    _route_matches_layer_route(num_tokens, H, E, 2)


@pytest.mark.parametrize("num_tokens,splits", [(33, 1), (130, 1), (40, 2)])
def test_tensor_core_route_matches_layer_route(num_tokens, splits, monkeypatch):
    """The tensor-core router logits (from ROUTE_TC_MIN_TOKENS bf16 tokens on, lowered here to
    33): the fp32 gate split into three bf16 parts, then the top-k kernel; the same experts as
    the layer's torch route and weights equal to fp32 rounding (16 experts, hidden 96: two K
    tiles, the last one partial; in one program or split over two, summed by the top-k kernel)."""
    from m3serve import envs
    monkeypatch.setattr(envs, "ROUTE_TENSOR_CORES", True)
    monkeypatch.setattr(fm, "ROUTE_TC_MIN_TOKENS", 33)
    monkeypatch.setattr(fm, "ROUTE_TC_SPLITS", splits)      # 2: hidden columns 0-63 and 64-95
    launched = record_launches(monkeypatch, fm, "_route_logits_tc_kernel")
    _route_matches_layer_route(num_tokens, 96, 16, 4)
    assert len(launched) == 1


def test_tensor_core_route_logits_split_the_gate_exactly():
    """One-hot bf16 rows pick single gate columns: the tensor-core logits equal those fp32
    values bit for bit, so hi + mid + lo is the weight exactly (values across 2^-30 .. 2^10,
    full 24-bit mantissas)."""
    hidden, experts, num_tokens = 64, 16, 40
    g = torch.Generator().manual_seed(7)
    gate = torch.randn(experts, hidden, generator=g) * torch.exp2(torch.randint(-30, 10, (experts, hidden),
                                                                               generator=g).float())
    cols = torch.arange(num_tokens) % hidden
    x = torch.zeros(num_tokens, hidden, dtype=torch.bfloat16)
    x[torch.arange(num_tokens), cols] = 1.0
    logits = torch.empty(1, num_tokens, experts)
    fm._route_logits_tc_kernel[(1, 1, 1)](x, gate, logits, num_tokens, hidden, x.stride(0), hidden,
                                          E=experts, BLOCK_T=64, BLOCK_E=experts, BLOCK_K=32, F32_DOTS=True)
    assert torch.equal(logits[0], gate[:, cols].t())


def test_fused_route_is_batch_invariant_with_hidden_splits():
    """At a hidden size that the router splits into several partial sums, a token's weights are
    bit-identical alone and inside batches of 3 and 17 tokens (the same summation order), and
    its experts agree with the torch route."""
    from m3serve.kernels.fused_moe import route_tiles
    hidden, experts = 768, 16
    assert route_tiles(1, experts, hidden)[3] > 1 and route_tiles(17, experts, hidden)[3] > 1
    g = torch.Generator().manual_seed(4)
    x = torch.randn(17, hidden, generator=g).to(torch.bfloat16)
    gate = torch.randn(experts, hidden, generator=g) * hidden ** -0.5
    bias = torch.randn(experts, generator=g) * 0.05
    alone = [moe_route(x[i:i + 1], gate, bias, 4, 2.0) for i in (0, 2, 16)]
    for n in (3, 17):
        weights, ids = moe_route(x[:n], gate, bias, 4, 2.0)
        for (w1, i1), row in zip(alone, (0, 2, 16)):
            if row < n:
                assert torch.equal(weights[row:row + 1], w1) and torch.equal(ids[row:row + 1], i1)
    ref_w, ref_ids = route(x, gate, bias, 4, 2.0)
    assert torch.equal(moe_route(x, gate, bias, 4, 2.0)[1].long(), ref_ids)


@pytest.mark.parametrize("num_tokens,top_k,block_m,first_expert,shared_expert", [
    (1, 2, 16, 0, False), (3, 4, 4, 0, True), (17, 2, 16, 2, True), (64, 4, 8, 0, False),
    (300, 4, 16, 0, True), (520, 4, 8, 1, True),   # > 2048 pairs: two launches
    (1700, 4, 16, 1, True)])                       # >= 8192 pairs: the pairs counted in parallel
def test_align_layout(num_tokens, top_k, block_m, first_expert, shared_expert):
    assert (num_tokens * (top_k + shared_expert) >= fm._PARALLEL_COUNT_PAIRS) == (num_tokens == 1700)
    g = torch.Generator().manual_seed(num_tokens)
    # Only a few experts and the out-of-range ids -1 and 9 appear: empty experts and drops.
    choices = torch.tensor([0, 2, 3, 6, -1, 9])
    ids = choices[torch.randint(0, len(choices), (num_tokens, top_k), generator=g)]
    sorted_ids, block_expert, num_post = moe_align(ids.to(torch.int32), E, block_m,
                                                   first_expert=first_expert,
                                                   shared_expert=shared_expert)
    ref_ids, ref_blocks, ref_post = moe_align_ref(ids, E, block_m, first_expert=first_expert,
                                                  shared_expert=shared_expert)
    assert torch.equal(block_expert, ref_blocks) and torch.equal(num_post, ref_post)
    assert sorted_ids.shape == ref_ids.shape
    num_choices = top_k + int(shared_expert)
    slots = ids - first_expert
    pos = 0
    for e in range(E + int(shared_expert)):  # same members per run (order inside is free)
        if e < E:
            members = torch.nonzero(slots.reshape(-1) == e).flatten()
            members = members // top_k * num_choices + members % top_k
        else:
            members = torch.arange(num_tokens) * num_choices + top_k
        padded = -(-members.numel() // block_m) * block_m
        run = sorted_ids[pos:pos + padded]
        assert sorted(run[:members.numel()].tolist()) == members.tolist()
        assert (run[members.numel():] == num_tokens * num_choices).all()
        pos += padded
    assert int(num_post) == pos and (sorted_ids[pos:] == num_tokens * num_choices).all()


def _same_alignment(got, want, num_pairs_padding):
    """Two alignments under moe_align's contract: the same block map and padded length, and the
    same pairs in each run (their order inside a run is free)."""
    (sorted_ids, blocks, post), (ref_sorted, ref_blocks, ref_post) = got, want
    assert torch.equal(blocks, ref_blocks) and torch.equal(post, ref_post)
    assert sorted_ids.shape == ref_sorted.shape
    for b in range(int(post) // (sorted_ids.numel() // blocks.numel())):
        m = sorted_ids.numel() // blocks.numel()
        assert sorted(sorted_ids[b * m:(b + 1) * m].tolist()) == sorted(ref_sorted[b * m:(b + 1) * m].tolist())
    assert (sorted_ids[int(post):] == num_pairs_padding).all()


@pytest.mark.parametrize("num_tokens,top_k,num_local,first_expert,shared_expert", [
    (1, 2, E, 0, True), (3, 4, E, 0, False), (16, 2, E, 0, True), (5, 2, 4, 4, True),
    (16, 4, 2, 2, False)])
def test_route_align_one_launch_matches_route_then_align(num_tokens, top_k, num_local,
                                                         first_expert, shared_expert):
    """The decode router + alignment in one launch: the same weights and ids as moe_route, bit
    for bit, and the same alignment as moe_align (also for one rank's expert range); run twice,
    so the counter the last program resets is seen to be reset."""
    g = torch.Generator().manual_seed(num_tokens * 7 + top_k)
    x = (torch.randn(num_tokens, H, generator=g) * 1.5).to(torch.bfloat16)
    gate, bias = torch.randn(E, H, generator=g), torch.randn(E, generator=g) * 0.1
    want_w, want_ids = moe_route(x, gate, bias, top_k, 2.0)
    want_align = moe_align_ref(want_ids, num_local, 4, first_expert=first_expert,
                               shared_expert=shared_expert)
    padding = num_tokens * (top_k + int(shared_expert))
    for _ in range(2):
        w, ids, alignment = fm.moe_route_align(x, gate, bias, top_k, 2.0, num_local, 4,
                                               first_expert=first_expert,
                                               shared_expert=shared_expert)
        assert torch.equal(w, want_w) and torch.equal(ids, want_ids)
        assert alignment[3] == 4
        _same_alignment(alignment[:3], want_align, padding)
        assert int(fm._counters[x.device]) == 0


def test_route_align_feeds_fused_moe():
    """fused_moe with moe_route_align's alignment equals fused_moe aligning itself; an alignment
    for another BLOCK_M is ignored (the pairs are aligned again); bad input is refused."""
    w13, w2, shared = _weights(5)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, H, generator=g)
    gate, bias = torch.randn(E, H, generator=g), torch.randn(E, generator=g) * 0.1
    block_m = fm.decode_block_m(6, 2, E, torch.float32)
    w, ids, alignment = fm.moe_route_align(x, gate, bias, 2, 2.0, E, block_m, shared_expert=True)
    want = fused_moe(x, w13, w2, w, ids, shared=shared)
    assert torch.equal(fused_moe(x, w13, w2, w, ids, shared=shared, alignment=alignment), want)
    other = fm.moe_route_align(x, gate, bias, 2, 2.0, E, 2 * block_m, shared_expert=True)[2]
    assert torch.equal(fused_moe(x, w13, w2, w, ids, shared=shared, alignment=other), want)
    with pytest.raises(ValueError, match="1-16 tokens"):
        fm.moe_route_align(torch.randn(17, H), gate, bias, 2, 2.0, E, block_m)


@pytest.mark.parametrize("num_tokens,top_k,dtype,use_shared,reduce", [
    (1, 2, torch.float32, True, "atomic"),
    (3, 4, torch.float32, False, "sum"),
    (17, 2, torch.float16, True, "atomic"),
    (64, 4, torch.float32, True, "sum"),
    (64, 4, torch.float16, False, "atomic"),
    (33, 4, torch.float16, True, "sum"),
])
def test_kernel_matches_ref(num_tokens, top_k, dtype, use_shared, reduce):
    w13, w2, shared = _weights(2, dtype=dtype)
    x, weights, ids = _routing(3, num_tokens, top_k, dtype=dtype)
    shared = shared if use_shared else None
    out = fused_moe(x, w13, w2, weights, ids, shared=shared, reduce=reduce)
    ref = fused_moe_ref(x, w13, w2, weights, ids, shared=shared, reduce=reduce)
    assert out.dtype == dtype and out.shape == (num_tokens, H)
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3)


def test_empty_experts_and_clamps():
    """All tokens on experts 1 and 5 (six experts get no rows); big activations hit both clamps."""
    w13, w2, shared = _weights(4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(17, H, generator=g) * 4.0
    ids = torch.tensor([[1, 5], [5, 1]] * 8 + [[1, 5]], dtype=torch.int32)
    weights = torch.rand(17, 2, generator=g)
    gate_up = x @ w13[1].t()
    assert (gate_up[:, :I] > LIMIT).any() and (gate_up[:, I:] < -LIMIT).any()
    out = fused_moe(x, w13, w2, weights, ids, shared=shared)
    ref = fused_moe_ref(x, w13, w2, weights, ids, shared=shared)
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_ref_matches_layer_ops(dtype, tol):
    """fused_moe_ref == experts_ref + the shared DenseMLP math (bf16: the layer op rounds the
    gate_up and expert outputs to bf16, the fused path keeps them fp32)."""
    w13, w2, shared = _weights(6, dtype=dtype)
    x, weights, ids = _routing(7, 33, 4, dtype=dtype)
    ref = fused_moe_ref(x, w13, w2, weights, ids, shared=shared)
    layer = experts_ref(x, w13, w2, weights, ids.long(), 0, ALPHA, LIMIT)
    layer = (layer + _shared_mlp(x, shared).float()).to(dtype)
    assert _rel(ref, layer) < tol


def test_kernel_matches_layer_ops_with_expert_slice():
    """This rank owns experts 4..7 of 8; other ids are skipped, and none aliases the shared slot."""
    w13, w2, shared = _weights(8)
    x, weights, ids = _routing(9, 17, 4)
    local13, local2 = w13[4:].contiguous(), w2[4:].contiguous()
    out = fused_moe(x, local13, local2, weights, ids, shared=shared, first_expert=4)
    layer = experts_ref(x, local13, local2, weights, ids.long(), 4, ALPHA, LIMIT)
    assert _rel(out, layer + _shared_mlp(x, shared)) < 1e-5


@pytest.mark.parametrize("poison", [float("nan"), 1e4])
def test_sum_skips_other_ranks_rows_and_adds_extra(monkeypatch, poison):
    """reduce="sum" on a rank owning experts 4..7: the [T, K, H] rows of the other experts are
    never written and must not be read (the buffer starts poisoned), and `extra` (the shared
    expert computed outside) is added; equal to the layer ops."""
    real_empty = torch.empty
    monkeypatch.setattr(fm.torch, "empty",
                        lambda *a, **k: real_empty(*a, **k).fill_(poison)
                        if k.get("dtype", torch.float32).is_floating_point else real_empty(*a, **k))
    w13, w2, shared = _weights(8)
    x, weights, ids = _routing(9, 17, 4)
    local13, local2 = w13[4:].contiguous(), w2[4:].contiguous()
    extra = _shared_mlp(x, shared)
    out = fused_moe(x, local13, local2, weights, ids, first_expert=4, reduce="sum", extra=extra)
    layer = experts_ref(x, local13, local2, weights, ids.long(), 4, ALPHA, LIMIT)
    assert torch.isfinite(out).all() and _rel(out, layer + extra) < 1e-5
    ref = fused_moe_ref(x, local13, local2, weights, ids, first_expert=4, reduce="sum", extra=extra)
    assert _rel(out, ref) < 1e-5


def test_sum_rounds_each_expert_output_like_the_reference():
    """fp16: the sum path rounds every expert's output to fp16 before the weighted fp32 sum, as
    the layer's reference ops do; closer to them than the atomic path's unrounded sum is."""
    w13, w2, shared = _weights(14, dtype=torch.float16)
    x, weights, ids = _routing(15, 40, 4, dtype=torch.float16)
    summed = fused_moe(x, w13, w2, weights, ids, shared=shared, reduce="sum")
    atomic = fused_moe(x, w13, w2, weights, ids, shared=shared, reduce="atomic")
    ref = fused_moe_ref(x, w13, w2, weights, ids, shared=shared, reduce="sum")
    assert _rel(summed, ref) < 2e-5          # summation order only
    assert _rel(atomic, ref) > 1e-4          # the unrounded sum is measurably elsewhere


def test_sum_into_a_column_strided_out():
    """The summing pass writes rows: an `out` whose columns are not contiguous still gets the sum."""
    w13, w2, shared = _weights(16)
    x, weights, ids = _routing(17, 9, 4)
    out = torch.full((H, 9), float("nan")).t()                   # [9, H], column stride 9
    fused_moe(x, w13, w2, weights, ids, shared=shared, reduce="sum", out=out)
    ref = fused_moe_ref(x, w13, w2, weights, ids, shared=shared, reduce="sum")
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("reduce", ["atomic", "sum"])
@pytest.mark.parametrize("case", ["shared", "narrow_shared", "expert_slice"])
def test_tensor_descriptor_tiles_match_ref(monkeypatch, reduce, case):
    """Both grouped GEMMs with their tiles through tensor descriptors (the Hopper path, forced
    on under the interpreter): the shared expert as wide as the routed ones or half as wide,
    and a rank owning experts 4..7."""
    monkeypatch.setattr(fm, "tma_ready", lambda device: True)
    config = fm._config(16, 32, 32, 1, 4, 1, tma=True)
    w13, w2, shared = _weights(18, inter_shared=I // 2 if case == "narrow_shared" else I)
    x, weights, ids = _routing(19, 21, 4)
    first = 4 if case == "expert_slice" else 0
    w13, w2 = w13[first:].contiguous(), w2[first:].contiguous()
    kw = dict(shared=None if case == "expert_slice" else shared, first_expert=first, reduce=reduce)
    out = fused_moe(x, w13, w2, weights, ids, config=config, **kw)
    assert _rel(out, fused_moe_ref(x, w13, w2, weights, ids, **kw)) < 1e-5


def test_fp8_narrow_shared_expert_ignores_unwritten_columns(monkeypatch):
    """FP8 with the shared expert half as wide as the routed ones: its h rows are re-quantised
    whole, so the columns past its width must be zeros, not whatever the buffer held (here a
    large finite value, which would set the rows' scales)."""
    real_empty = torch.empty
    monkeypatch.setattr(fm.torch, "empty",
                        lambda *a, **k: real_empty(*a, **k).fill_(
                            1e4 if k.get("dtype") != torch.float8_e4m3fn else 0.0)
                        if k.get("dtype", torch.float32).is_floating_point else real_empty(*a, **k))
    w13, w2, shared = _weights(20, inter_shared=I // 2)
    x, weights, ids = _routing(21, 7, 2)
    q13, s13 = quant_weight_fp8(w13)
    q2, s2 = quant_weight_fp8(w2)
    fp8_shared = (*(quant_weight_fp8(w)[0] for w in shared), *(quant_weight_fp8(w)[1] for w in shared))
    kw = dict(w13_scale=s13, w2_scale=s2, shared=fp8_shared)
    out = fused_moe(x, q13, q2, weights, ids, **kw)
    monkeypatch.undo()
    ref = fused_moe_ref(x, q13, q2, weights, ids, **kw)
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-5   # 0.017 with the leftovers


def test_shared_intermediate_differs():
    """Shared expert sharded by TP (I_s = I / 2) while routed experts keep I."""
    w13, w2, shared = _weights(10, inter_shared=I // 2)
    x, weights, ids = _routing(11, 9, 2)
    out = fused_moe(x, w13, w2, weights, ids, shared=shared)
    ref = experts_ref(x, w13, w2, weights, ids.long(), 0, ALPHA, LIMIT) + _shared_mlp(x, shared)
    assert _rel(out, ref) < 1e-5


def test_fp32_out_buffer_receives_sum():
    w13, w2, shared = _weights(12, dtype=torch.float16)
    x, weights, ids = _routing(13, 5, 2, dtype=torch.float16)
    out = torch.full((5, H), float("nan"))
    result = fused_moe(x, w13, w2, weights, ids, shared=shared, out=out)
    assert result is out
    assert _rel(out, fused_moe_ref(x, w13, w2, weights, ids, shared=shared, out=out.clone())) < 1e-4


def test_quant_rows_kernel_matches_ref():
    g = torch.Generator().manual_seed(14)
    x = torch.randn(6, 48, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0.0
    q, s = quant_rows_fp8(x)
    ref_q, ref_s = quant_rows_fp8_ref(x)
    assert torch.equal(q.float(), ref_q.float()) and torch.equal(s, ref_s)
    assert (q[2].float() == 0).all() and torch.isfinite(s).all()
    assert ((q.float() * s[:, None] - x).abs() <= x.abs().amax(1, keepdim=True) / 16).all()


@pytest.mark.parametrize("num_tokens,top_k", [(3, 2), (17, 4)])
def test_fp8_kernel_matches_ref(num_tokens, top_k):
    w13, w2, shared = _weights(15)
    x, weights, ids = _routing(16, num_tokens, top_k)
    q13, s13 = quant_weight_fp8(w13)
    q2, s2 = quant_weight_fp8(w2)
    qs13, ss13 = quant_weight_fp8(shared[0])
    qs2, ss2 = quant_weight_fp8(shared[1])
    fp8_shared = (qs13, qs2, ss13, ss2)
    out = fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, shared=fp8_shared)
    ref = fused_moe_ref(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, shared=fp8_shared)
    assert _rel(out, ref) < 1e-5
    # x's FP8 form made beforehand (the norm's, the same bits) gives the same sum, bit for bit
    given = fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, shared=fp8_shared,
                      x_quant=quant_rows_fp8(x))
    assert torch.equal(given, out)
    # Quantisation error against the unquantised weights stays at the e4m3 level.
    assert _rel(ref, fused_moe_ref(x, w13, w2, weights, ids, shared=shared)) < 0.1


def test_bad_inputs_raise():
    w13, w2, shared = _weights(17)
    x, weights, ids = _routing(18, 3, 2)
    with pytest.raises(ValueError, match="w13_scale"):
        fused_moe(x, w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn), weights, ids)
    with pytest.raises(ValueError, match="weights"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="shared"):
        fused_moe(x, w13, w2, weights, ids, shared=(shared[0], shared[0]))
    with pytest.raises(ValueError, match="reduce"):
        fused_moe(x, w13, w2, weights, ids, reduce="mean")
    with pytest.raises(ValueError, match="extra"):
        fused_moe(x, w13, w2, weights, ids, extra=x, reduce="atomic")
    with pytest.raises(ValueError, match="extra"):
        fused_moe(x, w13, w2, weights, ids, extra=x[:1])
    with pytest.raises(ValueError, match="top_k"):
        moe_route(x, torch.randn(E, H), torch.zeros(E), E + 1, 2.0)


def test_get_config_by_rows_per_expert(monkeypatch):
    monkeypatch.setattr(fm, "_INTERPRET", False)
    decode = fm.get_config(1, 3072, 6144, torch.bfloat16)
    prefill = fm.get_config(8192 * 4 // 128, 6144, 3072, torch.bfloat16)
    fp8 = fm.get_config(1, 3072, 6144, torch.float8_e4m3fn)
    assert decode["BLOCK_M"] == 16 and decode["BLOCK_K"] >= 128
    assert prefill["BLOCK_M"] >= 64
    assert fp8["BLOCK_K"] >= decode["BLOCK_K"]
    assert fm.get_config(1, 32, 64, torch.bfloat16)["BLOCK_N"] == 32  # clipped to the GEMM


def test_config_override_with_ragged_k_tiles():
    """A K tile wider than H and I takes the masked (uneven K) path in both GEMMs."""
    w13, w2, shared = _weights(19)
    x, weights, ids = _routing(20, 5, 2)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "GROUP_M": 2, "num_warps": 4,
           "num_stages": 1}
    out = fused_moe(x, w13, w2, weights, ids, shared=shared, config=cfg)
    assert _rel(out, fused_moe_ref(x, w13, w2, weights, ids, shared=shared)) < 1e-5


@pytest.mark.parametrize("split,dtype", [(2, torch.float32), (3, torch.float16)])
def test_split_k_gate_up_matches_ref(split, dtype):
    """Split K: the gate_up GEMM's four K steps in `split` ranges (3: one range shorter), their
    fp32 partial sums added in the down GEMM with SwiGLU; a narrower shared expert, both reduce
    modes."""
    w13, w2, shared = _weights(21, inter_shared=I // 2, dtype=dtype)
    x, weights, ids = _routing(22, 7, 2, dtype=dtype)
    cfg = (fm._config(16, 16, 16, 1, 4, 1, split_k=split), fm._config(16, 16, 16, 1, 4, 1))
    for reduce in ("atomic", "sum"):
        out = fused_moe(x, w13, w2, weights, ids, shared=shared, config=cfg, reduce=reduce)
        ref = fused_moe_ref(x, w13, w2, weights, ids, shared=shared, reduce=reduce)
        assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3), reduce


def test_split_token_counts_reach_every_decode_split():
    """Packed experts' decode gate_up splits K by step size; the warm-up's step sizes
    (`split_token_counts`) reach every split any step size up to the limit would use."""
    block_n = fm.get_config(1, 384, 6144, torch.bfloat16, True, packed=True)["BLOCK_N"]
    for pack in (1, 2, 3):
        counts = fm.split_token_counts(128, 4, 384, True, pack, 512)
        every = {fm.decode_split(t, 4, 128, 384, block_n, True, pack) for t in range(1, 513)}
        assert {fm.decode_split(t, 4, 128, 384, block_n, True, pack) for t in counts} == every
        assert len(every) > 1 and max(counts) <= 512


def test_grouped_gemms_compile_for_hopper(tmp_path):
    """Both grouped GEMMs (bf16 and fp8), the alignment (its parallel count too), the summing
    pass, the one-launch router + alignment and the tensor-core router logits compile for
    sm_90 with the bundled ptxas, no GPU needed."""
    from test_rmsnorm import compile_for_hopper
    ptr = {"x_ptr": "*bf16", "x_scale_ptr": "*fp32", "w_ptr": "*bf16", "w_scale_ptr": "*fp32",
           "ws_ptr": "*bf16", "ws_scale_ptr": "*fp32", "h_ptr": "*bf16", "h_scale_ptr": "*fp32",
           "out_ptr": "*fp32", "weights_ptr": "*fp32", "sorted_ids_ptr": "*i32",
           "block_expert_ptr": "*i32", "num_post_ptr": "*i32", "alpha": "fp32", "limit": "fp32",
           "zero_ptr": "*fp32", "part_ptr": "*fp32"}
    # fp8: GEMM1 reads e4m3 x and writes bf16 h; GEMM2 reads h re-quantised to e4m3
    fp8 = {**ptr, "x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp8e4nv"}
    decode = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "EVEN_K": True,
              "UPCAST": False, "TMA": False}
    # prefill tiles with tensor-descriptor loads (the sum path: bf16 expert outputs)
    prefill = {**decode, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "TMA": True}
    jobs = []
    for tiles, warps, reduce in ((decode, 4, {"ZERO": True, "ATOMIC": True}),
                                 (prefill, 8, {"ZERO": False, "ATOMIC": False})):
        for sig, use_fp8 in ((ptr, False), (fp8, True)):
            for name in ("_gemm1_swiglu_kernel", "_gemm2_kernel"):
                if use_fp8 and name == "_gemm2_kernel":
                    sig = {**sig, "h_ptr": "*fp8e4nv"}
                if not reduce["ATOMIC"] and name == "_gemm2_kernel":
                    sig = {**sig, "out_ptr": "*bf16"}
                names = set(fm.__dict__[name].arg_names)
                consts = {**tiles, "USE_FP8": use_fp8, "PACK": 0, "GDIV": True}
                consts.update({k: v for k, v in reduce.items() if k in names})
                if "SPLIT" in names:      # split K only without FP8 activations
                    consts["SPLIT"] = 4 if tiles is decode and not use_fp8 else 1
                if use_fp8 and tiles["TMA"]:
                    consts["BLOCK_K"] = 128
                jobs.append(["m3serve.kernels.fused_moe", name,
                             {k: v for k, v in sig.items() if k in names}, consts, warps])
    align = {"ids_ptr": "*i32", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
             "num_post_ptr": "*i32", "cursor_ptr": "*i32"}
    for counted in (False, True):
        jobs.append(["m3serve.kernels.fused_moe", "_align_plan_kernel", align,
                     {"HAS_SHARED": True, "BLOCK": 1024, "BINS": 256, "BLOCK_B": 32,
                      "SCATTER": not counted, "COUNTED": counted}, 4])
    jobs.append(["m3serve.kernels.fused_moe", "_align_count_kernel", {"ids_ptr": "*i32", "counts_ptr": "*i32"},
                 {"HAS_SHARED": True, "BLOCK": 1024, "BINS": 256}, 4])
    jobs.append(["m3serve.kernels.fused_moe", "_route_logits_tc_kernel",
                 {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32"},
                 {"E": 128, "BLOCK_T": fm.ROUTE_TC_BLOCK_T, "BLOCK_E": fm.ROUTE_TC_BLOCK_E,
                  "BLOCK_K": fm.ROUTE_TC_BLOCK_K, "F32_DOTS": False}, 8])
    summ = {"y_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32", "extra_ptr": "*bf16",
            "out_ptr": "*fp32"}
    jobs.append(["m3serve.kernels.fused_moe", "_split_swiglu_kernel",
                 {"part_ptr": "*fp32", "h_ptr": "*bf16", "num_post_ptr": "*i32", "alpha": "fp32",
                  "limit": "fp32"}, {"SPLIT": 4, "BLOCK_R": 16, "BLOCK_C": 128}, 4])
    jobs.append(["m3serve.kernels.fused_moe", "_moe_sum_kernel", summ,
                 {"BLOCK_H": 2048, "HAS_SHARED": True, "HAS_EXTRA": True}, 4])
    route = {"x_ptr": "*bf16", "w_ptr": "*fp32", "part_ptr": "*fp32", "bias_ptr": "*fp32",
             "weights_ptr": "*fp32", "ids_ptr": "*i32", "counter_ptr": "*i32", "scale": "fp32",
             **{k: "*i32" for k in ("sorted_ids_ptr", "block_expert_ptr", "num_post_ptr", "cursor_ptr")}}
    jobs.append(["m3serve.kernels.fused_moe", "_route_align_kernel", route,
                 {"BLOCK_T": 1, "BLOCK_E": 16, "BLOCK_K": 128, "E": 128, "SPLITS": 24, "TOP_K": 4,
                  "HAS_SHARED": True, "BLOCK": 1024, "BINS": 256, "BLOCK_B": 32}, 4])
    lines = compile_for_hopper(jobs, tmp_path)
    assert len(lines) == 15
    # the prefill tiles and the router's tensor-core logits run on wgmma (the 16-row decode
    # tiles are below its 64 rows)
    assert all(line.endswith("True") for line in lines[4:8])
    assert [line for line in lines if "_route_logits_tc_kernel" in line] == ["compiled _route_logits_tc_kernel True"]


def test_packed_warm_up_reaches_every_packed_tile_below_the_scratch(monkeypatch):
    """Packed experts run their own kernels below DEQUANT_MOE_MIN_TOKENS (the 16-bit ones
    from a dequantised scratch from there on, where it fits): the MoE layer's warm-up sizes
    reach, below that bound, every packed tile (and decode split K) a step there can pick --
    one TP 8 rank's experts (128 of width 384, 8 per token, the shared one in the kernel)."""
    from types import SimpleNamespace

    from m3serve.layers import moe as moe_mod
    monkeypatch.setattr(fm, "_INTERPRET", False)
    E, top_k, inter, hidden = 128, 8, 384, 6144
    layer = SimpleNamespace(
        dp=SimpleNamespace(active=False, size=1), tp=SimpleNamespace(size=8),
        cfg=SimpleNamespace(num_experts_per_tok=top_k, shared_intermediate_size=inter * 8, hidden_size=hidden),
        experts=SimpleNamespace(num_local=E, inter_local=inter, packed={"w13": SimpleNamespace(kind="mxfp4")}),
        tile_dtype=torch.bfloat16, _shared_in_kernel=lambda: True)
    bound = moe_mod.DEQUANT_MOE_MIN_TOKENS
    block_n = fm.get_config(1, inter, 1 << 20, torch.bfloat16, True, packed=True)["BLOCK_N"]

    def tiles(t):
        m = -(-t * top_k // E)
        up = fm.get_config(m, inter, hidden, torch.bfloat16, True, packed=True)
        split = fm.decode_split(t, top_k, E, inter, block_n, True, fm.PACK_CODES["mxfp4"]) if up["SPLIT_K"] == 0 else 1
        down = fm.get_config(m, hidden, inter, torch.bfloat16, False, packed=True)
        return tuple(up.values()), split, tuple(down.values())
    counts = moe_mod.MoE.tile_token_counts(layer, 16384)
    assert {tiles(t) for t in counts if t < bound} == {tiles(t) for t in range(1, bound)}


def test_regime_token_counts_reach_every_tile_regime(monkeypatch):
    """The warm-up's step sizes land in every tile regime of get_config: per replica, with the
    experts of one rank (EP) and the (token, choice) pairs of all DP replicas gathered."""
    monkeypatch.setattr(fm, "_INTERPRET", False)
    cases = [(128, 4), (16, 4), (128, 32)]                            # TP/EP1, EP8, DP8
    for (experts, pairs_per_token), dtype in itertools.product(cases, (torch.bfloat16, torch.float8_e4m3fn)):
        counts = fm.regime_token_counts(experts, pairs_per_token, 8192, dtype)
        assert counts[-1] == 8192
        tiles = {tuple(fm.get_config(-(-t * pairs_per_token // experts), 3072, 6144,
                                     dtype, True).values()) for t in counts}
        reachable = {tuple(fm.get_config(m, 3072, 6144, dtype, True).values())
                     for m in range(1, 8192 * pairs_per_token // experts + 1)}
        assert tiles == reachable
