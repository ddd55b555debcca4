"""Packed-weight kernels on a GPU at MiniMax-M3's widths (full model, and one TP 8 / TP 4
rank's): the dense product and the fused MoE with MXFP8 / MXFP4 / NVFP4 codes against their
reference, dequantise (`kernels/ref/packed.py`) then the bf16 product, at decode, verify and
prefill row counts, both reduce modes, and under CUDA-graph replay."""
import pytest
import torch

from packed_cases import FORMATS
from packed_cases import quantized as _quantized

pytestmark = pytest.mark.gpu


def quantized(w, fmt):
    return _quantized(w, fmt, torch.bfloat16)


H, I, E, K = 6144, 3072, 128, 4
TOL = 1e-2        # relative error of the output norm: summation order and bf16 outputs only


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# (N, K): fused qkv, o_proj, dense gate_up and down at full width and TP 8 / TP 4 rank widths
DENSE = [(12288 + 2048, 6144), (6144, 8192), (6144, 1024), (1792, 6144), (6144, 2048), (2304, 6144)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", DENSE)
def test_packed_matmul_real_widths(fmt, n, k):
    from m3serve.kernels.packed_gemm import packed_matmul
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    c, s, gs, kind, divides, wd = quantized(w, fmt)
    for rows in (1, 4, 16, 300):
        x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
        out = packed_matmul(x, c, s, gs, kind, divides)
        ref = x @ wd.t()
        assert out.dtype == torch.bfloat16 and _rel(out, ref) < TOL, (rows, _rel(out, ref))
        # the weight tile is the reference's: one row alone equals a float64 product closely
        exact = (x.double() @ wd.double().t())
        assert _rel(out, exact) < 5e-3
    # the prefill tiles with the column tiles first in the grid (benchmark variant)
    x = torch.randn(300, k, device="cuda", generator=g, dtype=torch.bfloat16)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "N_FIRST": True}
    assert _rel(packed_matmul(x, c, s, gs, kind, divides, config=cfg), x @ wd.t()) < TOL


@pytest.fixture(scope="module")
def experts():
    g = torch.Generator(device="cuda").manual_seed(0)
    return {"w13": torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02,
            "w2": torch.randn(E, H, I, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02,
            "gate": torch.randn(E, H, device="cuda", generator=g) * H ** -0.5,
            "bias": torch.randn(E, device="cuda", generator=g) * 0.01}


def _stacks(experts, fmt, inter):
    """Packed routed stacks cut to `inter` channels (a TP rank's width), a shared expert of the
    same width, and their dequantised bf16 twins."""
    w13 = torch.cat([experts["w13"][:, :inter], experts["w13"][:, I:I + inter]], 1)
    w2 = experts["w2"][..., :inter].contiguous()
    q13, q2 = [], []
    for e in range(E):          # per expert: fp32 temporaries of a whole stack would be large
        q13.append(quantized(w13[e], fmt))
        q2.append(quantized(w2[e], fmt))
    stack = lambda qs, i: None if qs[0][i] is None else torch.stack([q[i] for q in qs])
    s13, s2 = quantized(w13[0] * 1.1, fmt), quantized(w2[0] * 0.9, fmt)
    return ([stack(q13, i) for i in range(3)], [stack(q2, i) for i in range(3)], s13, s2,
            stack(q13, 5), stack(q2, 5), q13[0][3], q13[0][4])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("inter", [3072, 768, 384])
def test_fused_moe_packed_real_shapes(experts, fmt, inter):
    from m3serve.kernels.fused_moe import fused_moe, moe_route
    from m3serve.kernels.ref.fused_moe import fused_moe_ref
    p13, p2, s13, s2, d13, d2, kind, divides = _stacks(experts, fmt, inter)
    shared = (s13[0], s2[0], s13[1], s2[1]) + ((s13[2], s2[2]) if kind == "nvfp4" else ())
    for tokens in (1, 4, 16, 64, 640, 2600):
        g = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, H, device="cuda", generator=g, dtype=torch.bfloat16)
        w, ids = moe_route(x, experts["gate"], experts["bias"], K, 2.0)
        ref = fused_moe_ref(x, d13, d2, w, ids, shared=(s13[5], s2[5]))
        for reduce in ("atomic", "sum"):
            out = fused_moe(x, p13[0], p2[0], w, ids, w13_scale=p13[1], w2_scale=p2[1],
                            w13_global=p13[2], w2_global=p2[2], packed=kind,
                            global_divides=divides, shared=shared, reduce=reduce)
            assert _rel(out, ref) < TOL, (tokens, reduce, _rel(out, ref))


@pytest.mark.parametrize("fmt", [None] + FORMATS)
def test_fused_moe_split_k(experts, fmt):
    """The gate_up GEMM with its K split in 2 / 4 / 8 ranges (decode rows, one TP 8 rank's
    width), bf16 or packed experts, against the reference."""
    from m3serve.kernels.fused_moe import fused_moe, get_config, moe_route
    from m3serve.kernels.ref.fused_moe import fused_moe_ref
    p13, p2, s13, s2, d13, d2, kind, divides = _stacks(experts, fmt or "mxfp8", 384)
    if fmt is None:          # bf16 experts: the dequantised stacks themselves
        p13, p2 = [d13.to(torch.bfloat16), None, None], [d2.to(torch.bfloat16), None, None]
        shared, kind = (s13[5].to(torch.bfloat16), s2[5].to(torch.bfloat16)), None
    else:
        shared = (s13[0], s2[0], s13[1], s2[1]) + ((s13[2], s2[2]) if kind == "nvfp4" else ())
    for tokens in (1, 4, 16):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        w, ids = moe_route(x, experts["gate"], experts["bias"], K, 2.0)
        ref = fused_moe_ref(x, d13, d2, w, ids, shared=(s13[5], s2[5]))
        g1 = get_config(1, 384, H, torch.bfloat16, True)
        d1 = get_config(1, H, 384, torch.bfloat16, packed=kind is not None)
        for split in (2, 4, 8):
            out = fused_moe(x, p13[0], p2[0], w, ids, w13_scale=p13[1], w2_scale=p2[1],
                            w13_global=p13[2], w2_global=p2[2], packed=kind,
                            global_divides=divides, shared=shared,
                            config=({**g1, "SPLIT_K": split}, d1))
            assert _rel(out, ref) < TOL, (tokens, split, _rel(out, ref))


def test_fused_moe_packed_graph_replay(experts):
    """Captured once, replayed with new tokens: the replay sees them (no host reads)."""
    from m3serve.kernels.fused_moe import fused_moe, moe_route
    from m3serve.kernels.ref.fused_moe import fused_moe_ref
    p13, p2, s13, s2, d13, d2, kind, divides = _stacks(experts, "mxfp4", 384)
    x = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
    w, ids = moe_route(x, experts["gate"], experts["bias"], K, 2.0)
    out = torch.empty(4, H, device="cuda", dtype=torch.float32)

    def step():
        fused_moe(x, p13[0], p2[0], w, ids, w13_scale=p13[1], w2_scale=p2[1], packed=kind,
                  shared=(s13[0], s2[0], s13[1], s2[1]), out=out)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(torch.randn(4, H, device="cuda", dtype=torch.bfloat16))
    w2_, ids2 = moe_route(x, experts["gate"], experts["bias"], K, 2.0)
    w.copy_(w2_)
    ids.copy_(ids2)
    graph.replay()
    ref = fused_moe_ref(x, d13, d2, w, ids, shared=(s13[5], s2[5]))
    assert _rel(out, ref) < TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_prefill_scratch_is_the_dequantised_stack(experts, fmt):
    """Long prefill steps run packed experts from a dequantised bf16 scratch
    (`layers/packed.dequantized_scratch`): each element is the reference's dequantised weight
    rounded to bf16, and the bf16 kernels over it agree with the in-register packed product."""
    from torch import nn

    from m3serve.kernels.fused_moe import fused_moe, moe_route
    from m3serve.layers import packed as lp
    from m3serve.layers.packed import dequantized_scratch
    p13, p2, s13, s2, d13, d2, kind, divides = _stacks(experts, fmt, 384)
    m = nn.Module()
    m.w13, m.w13_block_scale, m.w2, m.w2_block_scale = p13[0], p13[1], p2[0], p2[1]
    pf = {"mxfp8": lp.MXFP8, "mxfp4": lp.MXFP4, "nvfp4": lp.NVFP4, "nvfp4-modelopt": lp.NVFP4_MODELOPT}[fmt]
    if pf.has_global:
        m.w13_global_scale, m.w2_global_scale = p13[2], p2[2]
    m.packed = {"w13": pf, "w2": pf}
    w13, w2 = dequantized_scratch(m, "w13", torch.bfloat16), dequantized_scratch(m, "w2", torch.bfloat16)
    assert torch.equal(w13, d13.to(torch.bfloat16)) and torch.equal(w2, d2.to(torch.bfloat16))
    x = torch.randn(2600, H, device="cuda", dtype=torch.bfloat16)
    w, ids = moe_route(x, experts["gate"], experts["bias"], K, 2.0)
    packed = fused_moe(x, p13[0], p2[0], w, ids, w13_scale=p13[1], w2_scale=p2[1], w13_global=p13[2],
                       w2_global=p2[2], packed=kind, global_divides=divides)
    assert _rel(fused_moe(x, w13, w2, w, ids), packed) < TOL


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "nvfp4-modelopt", "mxfp8"])
def test_dequantisation_exact_for_every_code_and_scale(fmt):
    """The GPU tile loaders (the ones the products use; here through `dequantize_weight`) give
    every code byte under every finite scale exactly the reference's value rounded to bf16:
    each row holds all 256 code bytes, rows and blocks walk the scale bytes (E8M0 64..190, i.e.
    2^-63..2^63, and every finite e4m3 block scale, with a global scale per row that divides or
    multiplies)."""
    import m3serve.kernels.ref.packed as rp
    from m3serve.kernels.packed_gemm import dequantize_weight
    kind, divides = fmt.split("-")[0], fmt != "nvfp4-modelopt"
    rows, nbytes = 254, 512
    r = torch.arange(rows, device="cuda")[:, None]
    codes = ((torch.arange(nbytes, device="cuda")[None, :] + 7 * r) % 256).to(torch.uint8)
    k = nbytes * (1 if kind == "mxfp8" else 2)
    if kind == "mxfp8":
        codes = codes.view(torch.float8_e4m3fn)
        finite = (codes.view(torch.uint8) & 0x7F) != 0x7F                 # e4m3 NaN codes out
        codes = torch.where(finite, codes.view(torch.uint8), 0).view(torch.float8_e4m3fn)
    nblocks = k // (16 if kind == "nvfp4" else 32)
    b = torch.arange(nblocks, device="cuda")[None, :]
    if kind == "nvfp4":
        byte = (r * 5 + b * 3) % 256
        byte = torch.where((byte & 0x7F) == 0x7F, 0x38, byte)            # 0x7F / 0xFF are NaN
        scales = byte.to(torch.uint8).view(torch.float8_e4m3fn)
        g = torch.rand(rows, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)) * 900 + 0.01
        want = rp.dequantize("nvfp4", codes, scales, g, divides)
    else:
        scales = (64 + (r + 37 * b) % 127).to(torch.uint8)
        g = None
        want = rp.dequantize(kind, codes, scales)
    got = dequantize_weight(codes, scales, g, kind, torch.bfloat16, divides)
    want = want.to(torch.bfloat16)
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), (got[~same][:8], want[~same][:8], same.logical_not().nonzero()[:8])
