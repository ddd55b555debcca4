"""The MXFP8 product with FP8 activations (`kernels/mxfp8_w8a8.py`) under the Triton interpreter
(CPU): against `ref/packed.w8a8_reference` (per-token e4m3 activations times the dequantised
weight, fp64 here) at small and at one TP 8 rank's widths, each block scale on its own K block,
each token's scale on its own row, bad operands, and compilation for sm_90 to FP8 wgmma."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run only without a GPU", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels.mxfp8_w8a8 import mxfp8_w8a8_gemm, mxfp8_w8a8_matmul  # noqa: E402
from m3serve.kernels.ref import packed as rp  # noqa: E402


def _weight(n, k, seed, spread=0):
    """MXFP8 codes [n, k] and E8M0 scales [n, k/32]: quantised from a Gaussian, or (spread > 0)
    random codes with exponents 127 +- spread, so every block's scale is its own."""
    g = torch.Generator().manual_seed(seed)
    if not spread:
        return rp.quantize_mxfp8(torch.randn(n, k, generator=g) * 0.05)
    codes = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.randint(127 - spread, 128 + spread, (n, k // 32), generator=g).to(torch.uint8)
    return codes, scales


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("m,n,k", [(5, 40, 96), (33, 70, 160), (130, 48, 256)])
def test_w8a8_equals_reference(m, n, k):
    """M not a multiple of the row tile, N not of the column tile, K = 32 x 3 / 5 / 8 (the K step
    of 128 is partial for 96 and 160). fp32: the kernel's sums differ from fp64 only by fp32
    rounding; bf16: one more rounding of each output."""
    c, s = _weight(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    ref = rp.w8a8_reference(x, c, s, torch.float64)
    out = mxfp8_w8a8_matmul(x, c, s)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    xb = x.to(torch.bfloat16)
    refb = rp.w8a8_reference(xb, c, s, torch.float64)
    outb = mxfp8_w8a8_matmul(xb, c, s)
    assert outb.dtype == torch.bfloat16
    assert ((outb.double() - refb).abs() <= refb.abs() * 2.0 ** -8 + 1e-6 * refb.abs().max()).all()


# one TP 8 rank of MiniMax-M3 (hidden 6144): fused qkv of a sparse layer (8 q heads + 1 kv head
# + index q / k: 1536 rows), o_proj (64 x 128 / 8 = 1024 inputs), the dense MLP's down (12288 / 8
# = 1536) and the shared expert's down (3072 / 8 = 384)
RANK = [(1536, 6144), (6144, 1024), (6144, 1536), (6144, 384)]


@pytest.mark.parametrize("n,k", RANK)
def test_w8a8_rank_widths(n, k):
    c, s = _weight(n, k, seed=n + k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    out = mxfp8_w8a8_matmul(x, c, s, config={"BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 128,
                                               "num_warps": 4, "num_stages": 1})
    assert _rel(out, rp.w8a8_reference(x, c, s, torch.float64)) < 1e-6


def test_each_block_scale_on_its_own_k_block():
    """Scales 2^-12 .. 2^12 vary block by block and row by row: the kernel equals the reference,
    and the same weight with its scales moved one block along K (what reading block kc // 32 +- 1
    would compute) is far from it, so an off-by-one block is caught."""
    c, s = _weight(24, 160, seed=1, spread=12)
    x = torch.randn(7, 160, generator=torch.Generator().manual_seed(2))
    ref = rp.w8a8_reference(x, c, s, torch.float64)
    for block_k in (32, 64):      # one or two scale blocks per K step (the default: four)
        cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 1}
        assert _rel(mxfp8_w8a8_matmul(x, c, s, config=cfg), ref) < 1e-6, block_k
    out = mxfp8_w8a8_matmul(x, c, s)
    assert _rel(out, ref) < 1e-6
    for shift in (1, -1):
        moved = rp.w8a8_reference(x, c, s.roll(shift, dims=1), torch.float64)
        assert _rel(out, moved) > 0.1
    # the same for the rows: a scale applied to the neighbouring output column is caught
    assert _rel(out, rp.w8a8_reference(x, c, s.roll(1, dims=0), torch.float64)) > 0.1


def test_each_token_scale_on_its_own_row():
    """Rows from 1e-4 to 1e4 in magnitude and an all-zero row: each row's product is right
    relative to its own size (one shared scale would flush the small rows to zero), and the
    zero row gives zeros, not NaN."""
    c, s = _weight(40, 128, seed=3)
    g = torch.Generator().manual_seed(4)
    mags = torch.tensor([1e-4, 1.0, 1e4, 0.0, 3e-2, 7e2])
    x = torch.randn(6, 128, generator=g) * mags[:, None]
    out = mxfp8_w8a8_matmul(x, c, s).double()
    ref = rp.w8a8_reference(x, c, s, torch.float64)
    for r in (0, 1, 2, 4, 5):
        assert ((out[r] - ref[r]).norm() / ref[r].norm()).item() < 1e-6, r
    assert torch.equal(out[3], torch.zeros(40, dtype=torch.float64))


def test_activations_are_quantised():
    """The product is W8A8's, not W8A16's: much closer to the FP8-activation reference than to
    dequantised weight x the activation as it is (which e4m3's 3 mantissa bits move by ~2 %)."""
    c, s = _weight(32, 256, seed=5)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(6))
    out = mxfp8_w8a8_matmul(x, c, s)
    w8a16 = x.double() @ rp.dequantize("mxfp8", c, s).double().t()
    assert _rel(out, rp.w8a8_reference(x, c, s, torch.float64)) < 1e-6
    assert _rel(out, w8a16) > 1e-3


def test_gemm_takes_given_quantised_rows():
    """The GEMM alone, with activation codes and scales given: xs[m] x sum_k xq w s."""
    c, s = _weight(16, 64, seed=7)
    xq = (torch.randn(4, 64, generator=torch.Generator().manual_seed(8)) * 50).to(torch.float8_e4m3fn)
    xs = torch.tensor([1.0, 0.5, 2.0 ** -10, 3.0])
    out = mxfp8_w8a8_gemm(xq, xs, c, s, torch.float32)
    want = (xq.double() * xs.double()[:, None]) @ rp.dequantize("mxfp8", c, s).double().t()
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-9)


def test_row_quantiser_rounds_ties_to_even():
    """bf16 rows put many x / scale exactly half-way between e4m3 values: the row quantiser
    rounds them to even as the GPU's cast and the reference do (not away from zero)."""
    from m3serve.kernels.fused_moe import quant_rows_fp8
    from m3serve.kernels.ref.fused_moe import quant_rows_fp8_ref
    x = torch.randn(33, 160, generator=torch.Generator().manual_seed(160)).to(torch.bfloat16)
    x[0, :3] = torch.tensor([448.0, 42.0, -34.0])    # scale 1; e4m3 steps by 4 in [32, 64)
    q, s = quant_rows_fp8(x)
    qr, sr = quant_rows_fp8_ref(x)
    assert torch.equal(s, sr)
    assert torch.equal(q.float(), qr.float())
    assert q[0, :3].float().tolist() == [448.0, 40.0, -32.0]


def test_w8a8_rejects_bad_operands():
    c, s = _weight(8, 64, seed=9)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="do not fit"):
        mxfp8_w8a8_matmul(torch.randn(2, 32), c, s)
    with pytest.raises(ValueError, match="do not fit"):
        mxfp8_w8a8_matmul(x, c, s[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mxfp8_w8a8_matmul(x, c.view(torch.uint8), s)
    with pytest.raises(ValueError, match="E8M0 bytes"):
        mxfp8_w8a8_matmul(x, c, s.float())
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        mxfp8_w8a8_matmul(x[0], c, s)
    with pytest.raises(ValueError, match="BLOCK_K must be 32, 64 or 128"):
        mxfp8_w8a8_matmul(x, c, s, config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256,
                                           "num_warps": 4, "num_stages": 1})
    with pytest.raises(ValueError, match="one scale per row"):
        mxfp8_w8a8_gemm(x.to(torch.float8_e4m3fn), torch.ones(3), c, s)
    assert mxfp8_w8a8_matmul(torch.randn(0, 64), c, s).shape == (0, 8)


_COMPILE = """
import json, os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from m3serve.kernels.mxfp8_w8a8 import _mxfp8_w8a8_kernel as fn, w8a8_config
types = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*u8",
         "out_ptr": "*bf16"}
# what the launcher specialises at run time: 16-byte aligned pointers, strides and K
aligned = list(types) + ["K", "stride_xm", "stride_wn", "stride_om"]
for m in json.loads(sys.argv[1]):
    cfg = w8a8_config(m, 1536, 6144)
    consts = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    consts.update(EVEN_K=True, UPCAST=False)
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(types)
    sig.update({c: "constexpr" for c in consts})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    ptx = k.asm["ptx"]
    print(json.dumps({"rows": m, "wgmma": sorted(set(re.findall(r"wgmma\\.mma_async[\\w.]*", ptx))),
                      "cp_async": ptx.count("cp.async.cg.shared.global")}), flush=True)
"""


def test_w8a8_compiles_to_fp8_wgmma(tmp_path):
    """For sm_90 at the tiles `w8a8_config` picks for 512 and 8192 rows: Hopper's warpgroup MMA
    with e4m3 x e4m3 operands (not an upcast to 16 bits), the operand loads pipelined (cp.async)."""
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([512, 8192])], env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert [ln["rows"] for ln in lines] == [512, 8192]
    for ln in lines:
        assert ln["wgmma"] and all(w.endswith(".f32.e4m3.e4m3") for w in ln["wgmma"]), ln
        assert ln["cp_async"] > 0, ln


def test_prefill_w8a8_bench_runs_on_cpu():
    """scripts/decode_kernels_bench.py prefill_w8a8's cases (the lead runs them on the GPU) run
    here with a fake clock: both paths' products checked against their references, one record
    per (shape, rows)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import decode_kernels_bench as bench
    clock = iter(range(1000, 0, -1))              # every later call "faster"
    recs = bench.prefill_w8a8_cases({"tiny": (48, 96)}, (20,), device="cpu",
                                    timer=lambda fn: (fn(), float(next(clock)))[1], sweep=False)
    (r,) = recs
    assert (r["N"], r["K"], r["M"]) == (48, 96, 20) and "check_failed" not in r and not r["errors"]
    assert r["max_rel_err_w8a16_vs_ref"] < 5e-3 and r["max_rel_err_w8a8_vs_ref"] < 5e-3
    assert r["max_rel_err_w8a8_vs_w8a16_ref"] > 5e-3          # FP8 activations do change it
