"""Packed-weight kernels under the Triton interpreter (CPU, small shapes): the dense product
and the fused MoE with MXFP8 / MXFP4 / NVFP4 codes against the reference (dequantise with
`kernels/ref/packed.py`, then multiply), bad shapes, and compilation for sm_90."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run only without a GPU", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels.fused_moe import fused_moe, moe_route
from m3serve.kernels.packed_gemm import packed_matmul
from m3serve.kernels.ref import packed as rp
from packed_cases import FORMATS, quantized
from m3serve.kernels.ref.fused_moe import fused_moe_ref



@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_matmul_equals_dequantised_product(fmt, dtype):
    """K = 96 (three MX blocks: the last K step is partial), N = 40 (a partial column tile),
    5 rows. fp16: the dequantised weights and the fp32 sums round once, so the product equals
    the double-precision one rounded to fp16 almost everywhere."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=g) * 0.05
    x = torch.randn(5, 96, generator=g).to(dtype)
    c, s, gs, kind, divides, wd = quantized(w, fmt)
    out = packed_matmul(x, c, s, gs, kind, divides)
    ref = (x.double() @ wd.to(dtype).double().t())
    assert out.dtype == dtype and out.shape == (5, 40)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    # the column tiles first in the grid: the same product
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1, "N_FIRST": True}
    x2 = torch.cat([x] * 4)                                        # 20 rows: two row tiles
    torch.testing.assert_close(packed_matmul(x2, c, s, gs, kind, divides, config=cfg).double(),
                               torch.cat([ref] * 4), rtol=tol, atol=tol)
    # the nibble order matters: swapping them is a different weight
    if kind != "mxfp8":
        swapped = (c >> 4) | ((c & 15) << 4)
        assert not torch.allclose(packed_matmul(x, swapped, s, gs, kind, divides).double(), ref,
                                  rtol=1e-2, atol=1e-2)


def test_packed_matmul_rejects_bad_operands():
    c, s = rp.quantize_mxfp4(torch.randn(8, 64))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="unknown packed format"):
        packed_matmul(x, c, s, None, "int4")
    with pytest.raises(ValueError, match="do not fit"):
        packed_matmul(torch.randn(2, 32), c, s, None, "mxfp4")
    with pytest.raises(ValueError, match="do not fit"):
        packed_matmul(x, c, s[:, :1], None, "mxfp4")
    cn, sn = rp.quantize_nvfp4(torch.randn(8, 64), torch.ones(8))
    with pytest.raises(ValueError, match="global scale"):
        packed_matmul(x, cn, sn, None, "nvfp4")


H, I, E, I_S = 64, 64, 8, 32


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_moe_packed_equals_dequantised(fmt, split):
    """Routed experts (top-2 of 8) + a narrower shared expert, both reduce modes, against the
    fused MoE's reference on the dequantised weights; split=3: the gate_up GEMM's K (two
    steps) in three ranges, one of them empty, summed with SwiGLU by the down GEMM."""
    g = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3
    s13, s2 = torch.randn(2 * I_S, H, generator=g) * 0.3, torch.randn(H, I_S, generator=g) * 0.3
    x = torch.randn(5, H, generator=g) * 1.5
    weights, ids = moe_route(x, torch.randn(E, H, generator=g), torch.randn(E, generator=g) * 0.1,
                             2, 2.0)
    a, b, c, d = (quantized(w, fmt) for w in (w13, w2, s13, s2))
    kind, divides = a[3], a[4]
    ref = fused_moe_ref(x, a[5], b[5], weights, ids, shared=(c[5], d[5]))
    shared = (c[0], d[0], c[1], d[1]) + ((c[2], d[2]) if kind == "nvfp4" else ())
    from m3serve.kernels.fused_moe import _config
    config = (_config(16, 32, 32, 1, 4, 1, split_k=split), _config(16, 32, 32, 1, 4, 1))
    for reduce in ("atomic", "sum"):
        out = fused_moe(x, a[0], b[0], weights, ids, w13_scale=a[1], w2_scale=b[1],
                        w13_global=a[2], w2_global=b[2], packed=kind, global_divides=divides,
                        shared=shared, reduce=reduce, config=config)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5, reduce
    # a wrong block-scale shape names the tensor
    with pytest.raises(ValueError, match="w2 block scales"):
        fused_moe(x, a[0], b[0], weights, ids, w13_scale=a[1], w2_scale=b[1][..., :1],
                  w13_global=a[2], w2_global=b[2], packed=kind, shared=shared)


def test_packed_kernels_compile_for_hopper(tmp_path):
    """The dense kernel and both grouped GEMMs compile for sm_90 in every packed format, at
    decode and prefill tiles, with bf16 activations."""
    from test_rmsnorm import compile_for_hopper

    from m3serve.kernels import fused_moe as fm
    dense = {"x_ptr": "*bf16", "s_ptr": "*u8", "g_ptr": "*fp32", "out_ptr": "*bf16"}
    moe = {"x_ptr": "*bf16", "x_scale_ptr": "*fp32", "w_scale_ptr": "*u8", "ws_scale_ptr": "*u8",
           "h_ptr": "*bf16", "h_scale_ptr": "*fp32", "out_ptr": "*fp32", "weights_ptr": "*fp32",
           "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_post_ptr": "*i32",
           "alpha": "fp32", "limit": "fp32", "zero_ptr": "*fp32", "g_ptr": "*fp32",
           "gs_ptr": "*fp32", "part_ptr": "*fp32"}
    jobs = []
    for fmt, code, scale in ((1, "*fp8e4nv", "*u8"), (2, "*u8", "*u8"), (3, "*u8", "*fp8e4nv")):
        for bm, bn, bk, warps in ((16, 32, 256, 4), (64, 128, 64, 8)):
            jobs.append(["m3serve.kernels.packed_gemm", "_packed_matmul_kernel",
                         {**dense, "w_ptr": code, "s_ptr": scale},
                         {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "FMT": fmt, "GDIV": True,
                          "UPCAST": False, "N_FIRST": bm == 64}, warps])
            tiles = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "EVEN_K": False,
                     "USE_FP8": False, "UPCAST": False, "TMA": False, "PACK": fmt, "GDIV": True}
            sig = {**moe, "w_ptr": code, "ws_ptr": code, "w_scale_ptr": scale, "ws_scale_ptr": scale}
            for name, extra in (("_gemm1_swiglu_kernel", {"ZERO": True, "SPLIT": 4 if bm == 16 else 1}),
                                ("_gemm2_kernel", {"ATOMIC": True})):
                names = set(fm.__dict__[name].arg_names)
                jobs.append(["m3serve.kernels.fused_moe", name,
                             {k: v for k, v in sig.items() if k in names}, {**tiles, **extra}, warps])
    lines = compile_for_hopper(jobs, tmp_path)
    assert len(lines) == len(jobs), lines
    # Hopper's warpgroup MMA for the 64-row prefill tiles (16-row decode tiles use mma.sync)
    assert [ln.endswith("True") for ln in lines] == [j[3]["BLOCK_M"] == 64 for j in jobs], lines


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_weight_is_the_reference_rounded(fmt, dtype):
    """The prefill path's scratch weight (`dequantize_weight`): every element equals the
    reference's dequantised value rounded to the activation dtype, N and K off the tile."""
    from m3serve.kernels.packed_gemm import dequantize_weight

    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(3))
    c, s, g, kind, divides, want = quantized(w, fmt, dtype)
    got = dequantize_weight(c, s, g, kind, dtype, divides)
    assert got.dtype == dtype and torch.equal(got, want)
