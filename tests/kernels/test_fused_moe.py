"""Fused MoE on a GPU at MiniMax-M3 shapes (H=6144, I=3072, E=128, top-4 + shared expert), bf16
and PTPC FP8, ragged token counts, against fused_moe_ref and the lead's layer ops.

Tolerances are relative errors of the output norm; the kernel and the reference share rounding
points (fp32 GEMMs, h rounded to bf16), so what is left is summation order and bf16 output."""
import pytest
import torch

pytestmark = pytest.mark.gpu

H, I, E, K = 6144, 3072, 128, 4
ALPHA, LIMIT = 1.702, 7.0
BF16_TOL = 1e-2      # kernel vs ref, bf16
FP8_TOL = 2e-2       # kernel vs ref, both FP8
FP8_VS_BF16_TOL = 0.1  # FP8 ref vs bf16 ref: e4m3 quantisation of weights and activations
LAYER_TOL = 2e-2     # ref vs experts_ref (which rounds gate_up and expert outputs to bf16)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def weights():
    from m3serve.kernels.ref.fused_moe import quant_weight_fp8
    g = torch.Generator(device="cuda").manual_seed(0)
    # std 0.02 keeps gate/up around +-1.5 for unit-variance inputs, like a trained layer.
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    shared = (torch.randn(2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02,
              torch.randn(H, I, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02)
    q13 = torch.empty_like(w13, dtype=torch.float8_e4m3fn)
    q2 = torch.empty_like(w2, dtype=torch.float8_e4m3fn)
    s13 = torch.empty(E, 2 * I, device="cuda")
    s2 = torch.empty(E, H, device="cuda")
    for e in range(E):  # per expert: the fp32 temporaries of the whole stack would be 29 GB
        q13[e], s13[e] = quant_weight_fp8(w13[e])
        q2[e], s2[e] = quant_weight_fp8(w2[e])
    qs13, ss13 = quant_weight_fp8(shared[0])
    qs2, ss2 = quant_weight_fp8(shared[1])
    gate = torch.randn(E, H, device="cuda", generator=g)
    bias = torch.randn(E, device="cuda", generator=g) * 0.01
    return {"w13": w13, "w2": w2, "shared": shared, "q13": q13, "q2": q2, "s13": s13, "s2": s2,
                "fp8_shared": (qs13, qs2, ss13, ss2), "gate": gate, "bias": bias}


def _inputs(weights, num_tokens, seed):
    from m3serve.kernels.fused_moe import moe_route
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, H, device="cuda", generator=g, dtype=torch.bfloat16)
    route_w, ids = moe_route(x, weights["gate"], weights["bias"], K, 2.0)
    return x, route_w, ids


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 17, 32])
def test_fused_route_matches_torch_route_real_shapes(num_tokens):
    """The decode router kernels at the real 128 experts x 6144, logits of order 1: the same
    experts as the layer's torch route (fp32 cuBLAS) and weights equal to fp32 rounding."""
    from m3serve.kernels.fused_moe import moe_route
    from m3serve.layers.moe import route
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, 6144, device="cuda", generator=g, dtype=torch.bfloat16)
    gate = torch.randn(128, 6144, device="cuda", generator=g) * 6144 ** -0.5
    bias = torch.randn(128, device="cuda", generator=g) * 0.05
    weights, ids = moe_route(x, gate, bias, 4, 2.5)
    ref_w, ref_ids = route(x, gate, bias, 4, 2.5)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [33, 100, 1000, 16384])
def test_tensor_core_route_matches_torch_route_real_shapes(num_tokens, monkeypatch):
    """The tensor-core router logits at the real 128 experts x 6144 (from 33 tokens on here; by
    default from ROUTE_TC_MIN_TOKENS): the tensor-core logits (the fp32
    gate in three exact bf16 parts) give the torch route's experts, except where the reference's
    4th and 5th choice values are within fp32 rounding of each other (a near tie, either way),
    and its weights to fp32 rounding."""
    from m3serve import envs
    from m3serve.kernels import fused_moe as fm
    from m3serve.kernels.fused_moe import moe_route
    from m3serve.layers.moe import route
    monkeypatch.setattr(envs, "ROUTE_TENSOR_CORES", True)
    monkeypatch.setattr(fm, "ROUTE_TC_MIN_TOKENS", 33)
    from launches import record_launches
    launched = record_launches(monkeypatch, fm, "_route_logits_tc_kernel")
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, 6144, device="cuda", generator=g, dtype=torch.bfloat16)
    gate = torch.randn(128, 6144, device="cuda", generator=g) * 6144 ** -0.5
    bias = torch.randn(128, device="cuda", generator=g) * 0.05
    weights, ids = moe_route(x, gate, bias, 4, 2.5)
    assert len(launched) == 1
    ref_w, ref_ids = route(x, gate, bias, 4, 2.5)
    choice = torch.sigmoid(x.float() @ gate.t()) + bias
    top5 = choice.topk(5, dim=-1).values
    differ = (ids.long().sort(-1).values != ref_ids.sort(-1).values).any(-1)
    assert ((top5[:, 3] - top5[:, 4])[differ] < 1e-5).all()
    assert differ.sum().item() <= max(1, num_tokens // 1000)
    same = ~differ
    # a token's experts in the same set may come in another order where two choice values tie
    # within fp32 rounding (measured on an H100 at 1000 tokens): compare the weights by expert
    order, ref_order = ids.long().argsort(-1), ref_ids.argsort(-1)
    torch.testing.assert_close(weights.gather(1, order)[same], ref_w.gather(1, ref_order)[same],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 64, 256, 640, 1087, 2600, 4096, 8192])
def test_bf16_matches_ref(weights, num_tokens):
    from m3serve.kernels.fused_moe import fused_moe
    from m3serve.kernels.ref.fused_moe import fused_moe_ref
    x, route_w, ids = _inputs(weights, num_tokens, num_tokens)
    args = (x, weights["w13"], weights["w2"], route_w, ids)
    ref = fused_moe_ref(*args, shared=weights["shared"])
    out = fused_moe(*args, shared=weights["shared"])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _rel(out, ref) < BF16_TOL
    summed = fused_moe(*args, shared=weights["shared"], reduce="sum")
    assert _rel(summed, fused_moe_ref(*args, shared=weights["shared"], reduce="sum")) < BF16_TOL
    # an fp32 out is the atomic target itself: the first GEMM clears all of it (NaN before)
    out32 = torch.full(out.shape, float("nan"), device="cuda")
    fused_moe(*args, shared=weights["shared"], out=out32, reduce="atomic")
    assert torch.isfinite(out32).all() and _rel(out32, ref) < BF16_TOL


# 640 / 1087 / 2600 tokens: 20 / 34 / 82 rows per expert, in the medium / large / largest tiles
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 256, 640, 1087, 2600, 4096])
def test_fp8_matches_ref(weights, num_tokens):
    from m3serve.kernels.fused_moe import fused_moe
    from m3serve.kernels.ref.fused_moe import fused_moe_ref
    x, route_w, ids = _inputs(weights, num_tokens, 100 + num_tokens)
    args = (x, weights["q13"], weights["q2"], route_w, ids)
    kw = {"w13_scale": weights["s13"], "w2_scale": weights["s2"], "shared": weights["fp8_shared"]}
    ref = fused_moe_ref(*args, **kw)
    out = fused_moe(*args, **kw)
    assert _rel(out, ref) < FP8_TOL
    bf16_ref = fused_moe_ref(x, weights["w13"], weights["w2"], route_w, ids,
                             shared=weights["shared"])
    assert _rel(out, bf16_ref) < FP8_VS_BF16_TOL


@pytest.mark.parametrize("num_tokens", [640, 2600, 8192])
@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_tiles_tma_and_sum(weights, num_tokens, fp8, monkeypatch):
    """The prefill path: tensor-descriptor (TMA) weight tiles, expert outputs stored and summed
    (reduce="sum"), with the shared expert inside the grouped GEMMs or added as `extra`; on a
    rank owning experts 64..127 the other experts' rows are skipped (buffers start as NaN)."""
    from m3serve.kernels import fused_moe as fm
    from m3serve.kernels.ref.fused_moe import fused_moe_ref
    x, route_w, ids = _inputs(weights, num_tokens, 200 + num_tokens)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    m_avg = -(-num_tokens * K // E)
    config = ({**fm.get_config(m_avg, I, H, dtype, True), "TMA": True},
              {**fm.get_config(m_avg, H, I, dtype), "TMA": True})
    if fp8:
        w13, w2, shared = weights["q13"], weights["q2"], weights["fp8_shared"]
        kw, tol = {"w13_scale": weights["s13"], "w2_scale": weights["s2"]}, FP8_TOL
    else:
        w13, w2, shared, kw, tol = weights["w13"], weights["w2"], weights["shared"], {}, BF16_TOL
    ref = fused_moe_ref(x, w13, w2, route_w, ids, shared=shared, reduce="sum", **kw)
    out = fm.fused_moe(x, w13, w2, route_w, ids, shared=shared, reduce="sum", config=config, **kw)
    assert torch.isfinite(out).all() and _rel(out, ref) < tol
    extra = fused_moe_ref(x, w13[:0], w2[:0], route_w, ids, shared=shared, reduce="sum", **{
        k: v[:0] for k, v in kw.items()})                        # the shared expert alone
    out = fm.fused_moe(x, w13, w2, route_w, ids, extra=extra, reduce="sum", config=config, **kw)
    assert _rel(out, ref) < tol
    real_empty = torch.empty
    monkeypatch.setattr(fm.torch, "empty", lambda *a, **k: (
        real_empty(*a, **k).fill_(float("nan")) if k.get("dtype", torch.float32).is_floating_point
        else real_empty(*a, **k)))
    half = {k: v[64:] for k, v in kw.items()}
    out = fm.fused_moe(x, w13[64:], w2[64:], route_w, ids, first_expert=64, reduce="sum",
                       config=config, **half)
    monkeypatch.undo()
    ref = fused_moe_ref(x, w13[64:], w2[64:], route_w, ids, first_expert=64, reduce="sum", **half)
    assert torch.isfinite(out).all() and _rel(out, ref) < tol


def test_ref_matches_layer_ops(weights):
    from m3serve.kernels.ref.fused_moe import fused_moe_ref
    from m3serve.layers.activation import swiglu_oai_ref as swiglu_oai
    from m3serve.layers.moe import experts_ref, route
    x, route_w, ids = _inputs(weights, 64, 7)
    layer_w, layer_ids = route(x, weights["gate"], weights["bias"], K, 2.0)
    assert torch.equal(layer_ids, ids.long())
    torch.testing.assert_close(layer_w, route_w)
    s13, s2 = weights["shared"]
    layer = experts_ref(x, weights["w13"], weights["w2"], layer_w, layer_ids, 0, ALPHA, LIMIT)
    layer = layer + (swiglu_oai(x @ s13.t(), ALPHA, LIMIT) @ s2.t()).float()
    ref = fused_moe_ref(x, weights["w13"], weights["w2"], route_w, ids, shared=weights["shared"])
    assert _rel(ref, layer) < LAYER_TOL


def test_expert_slice_and_fp32_out(weights):
    """Rank 1 of 2 (experts 64..127): other ids skipped; fp32 out keeps the unrounded sum."""
    from m3serve.kernels.fused_moe import fused_moe
    from m3serve.kernels.ref.fused_moe import fused_moe_ref
    x, route_w, ids = _inputs(weights, 17, 11)
    w13, w2 = weights["w13"][64:], weights["w2"][64:]
    out = torch.empty(17, H, device="cuda")
    fused_moe(x, w13, w2, route_w, ids, first_expert=64, out=out)
    ref = fused_moe_ref(x, w13, w2, route_w, ids, first_expert=64, out=torch.empty_like(out))
    assert _rel(out, ref) < 5e-3


@pytest.mark.parametrize("num_tokens,block_m", [(1, 16), (256, 16), (8192, 128)])
def test_align_matches_ref(weights, num_tokens, block_m):
    from m3serve.kernels.fused_moe import moe_align
    from m3serve.kernels.ref.fused_moe import moe_align_ref
    _, _, ids = _inputs(weights, num_tokens, 3)
    sorted_ids, blocks, post = moe_align(ids, E, block_m, shared_expert=True)
    ref_ids, ref_blocks, ref_post = moe_align_ref(ids, E, block_m, shared_expert=True)
    assert torch.equal(blocks, ref_blocks) and torch.equal(post, ref_post)
    runs = torch.repeat_interleave(blocks.long().clamp(min=0), block_m)  # slot of every position
    key = runs * (num_tokens * (K + 1) + 1)  # sort inside runs only: the order there is free
    assert torch.equal(torch.sort(key + sorted_ids).values, torch.sort(key + ref_ids).values)


@pytest.mark.parametrize("inter", [384, 768])                    # one TP 8 / TP 4 rank's experts
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 64])
@pytest.mark.parametrize("fp8", [False, True])
def test_rank_widths_match_ref(weights, inter, num_tokens, fp8):
    """The narrow decode tiles of one TP rank's experts (NARROW_GATE_UP / NARROW_DOWN): the
    slice [rank 0's channels] of every expert, against the reference on the same slice."""
    from m3serve.kernels import fused_moe as fm
    from m3serve.kernels.ref.fused_moe import fused_moe_ref, quant_weight_fp8
    x, route_w, ids = _inputs(weights, num_tokens, 300 + num_tokens)
    w13 = torch.cat([weights["w13"][:, :inter], weights["w13"][:, I:I + inter]], dim=1).contiguous()
    w2 = weights["w2"][:, :, :inter].contiguous()
    s13 = torch.cat([weights["shared"][0][:inter], weights["shared"][0][I:I + inter]]).contiguous()
    shared = (s13, weights["shared"][1][:, :inter].contiguous())
    assert fm.get_config(1, inter, H, w13.dtype, True) == {**fm.NARROW_GATE_UP[False], "TMA": False, "SUM": False}
    kw = {"shared": shared}
    if fp8:
        q13, q2 = torch.empty_like(w13, dtype=torch.float8_e4m3fn), torch.empty_like(w2, dtype=torch.float8_e4m3fn)
        sc13, sc2 = torch.empty(E, 2 * inter, device="cuda"), torch.empty(E, H, device="cuda")
        for e in range(E):
            q13[e], sc13[e] = quant_weight_fp8(w13[e])
            q2[e], sc2[e] = quant_weight_fp8(w2[e])
        (qs13, ss13), (qs2, ss2) = quant_weight_fp8(shared[0]), quant_weight_fp8(shared[1])
        w13, w2 = q13, q2
        kw = {"w13_scale": sc13, "w2_scale": sc2, "shared": (qs13, qs2, ss13, ss2)}
    args = (x, w13, w2, route_w, ids)
    out = fm.fused_moe(*args, **kw)
    assert _rel(out, fused_moe_ref(*args, **kw)) < (FP8_TOL if fp8 else BF16_TOL)


@pytest.mark.parametrize("num_tokens", [1, 4, 16])
@pytest.mark.parametrize("num_local,first_expert", [(128, 0), (16, 32)])   # TP, one EP-8 rank
def test_route_align_one_launch_real_shapes(weights, num_tokens, num_local, first_expert):
    """The decode router + alignment in one launch at 128 experts x 6144, eagerly 20 times and
    replayed 20 times in a CUDA graph (the last program's hand-off between programs, under
    real concurrency): the weights and ids of moe_route bit for bit, moe_align's block map and
    padded length, the same pairs per block; the end-to-end MoE with it equals the reference."""
    from m3serve.kernels import fused_moe as fm
    from m3serve.kernels.ref.fused_moe import fused_moe_ref, moe_align_ref
    g = torch.Generator(device="cuda").manual_seed(num_tokens + first_expert)
    x = torch.randn(num_tokens, H, device="cuda", generator=g, dtype=torch.bfloat16)
    gate, bias = weights["gate"] * H ** -0.5, weights["bias"]
    want_w, want_ids = fm.moe_route(x, gate, bias, K, 2.0)
    want = moe_align_ref(want_ids, num_local, 16, first_expert=first_expert, shared_expert=True)

    def check(w, ids, alignment):
        assert torch.equal(w, want_w) and torch.equal(ids, want_ids)
        sorted_ids, blocks, post = alignment[:3]
        assert torch.equal(blocks, want[1]) and torch.equal(post, want[2])
        runs = sorted_ids[:int(post)].view(-1, 16).sort(dim=1).values
        assert torch.equal(runs, want[0][:int(post)].view(-1, 16).sort(dim=1).values)

    call = lambda: fm.moe_route_align(x, gate, bias, K, 2.0, num_local, 16,  # noqa: E731
                                      first_expert=first_expert, shared_expert=True)
    for _ in range(20):
        check(*call())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        check(*out)
    w, ids, alignment = out
    w13, w2 = weights["w13"][first_expert:first_expert + num_local], weights["w2"][first_expert:first_expert + num_local]
    got = fm.fused_moe(x, w13, w2, w, ids, shared=weights["shared"], first_expert=first_expert,
                       alignment=alignment)
    ref = fused_moe_ref(x, w13, w2, w, ids, shared=weights["shared"], first_expert=first_expert)
    assert _rel(got, ref) < BF16_TOL
