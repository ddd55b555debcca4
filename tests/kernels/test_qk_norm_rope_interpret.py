"""CPU interpreter tests of the fused QK norm + RoPE + cache-write kernel at tiny shapes, the
reference against the attention layer's own ops (gemma_rms_norm, apply_rotary, write_cache_ref),
host-sync freedom of the launcher, and an offline sm_90 compile of every job kind."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels import qk_norm_rope as qk_mod  # noqa: E402
from m3serve.kernels.qk_norm_rope import qk_norm_rope_cache  # noqa: E402
from m3serve.kernels.ref.qk_norm_rope import qk_norm_rope_cache_ref  # noqa: E402
from m3serve.layers.attention_metadata import write_cache_ref  # noqa: E402
from m3serve.layers.norm import gemma_rms_norm  # noqa: E402
from m3serve.layers.rotary import apply_rotary  # noqa: E402
from test_qk_norm_rope import make_inputs, run_both  # noqa: E402
from test_rmsnorm import HostSyncGuard, compile_for_hopper  # noqa: E402

TINY = dict(T=7, Hq=4, G=2, D=32, Hi=2, Di=32, half=8, num_blocks=4, block_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_layer_ops(dtype):
    x = make_inputs(**TINY, dtype=dtype, device="cpu")
    kv, idx = x["kv_cache"].clone(), x["index_cache"].clone()
    q, iq = qk_norm_rope_cache_ref(**x)
    eps, cos, sin, sl = x["eps"], x["cos"], x["sin"], x["slot_mapping"]
    q_l = apply_rotary(gemma_rms_norm(x["q"], x["q_norm_w"], eps), cos, sin)
    k_l = apply_rotary(gemma_rms_norm(x["k"], x["k_norm_w"], eps), cos, sin)
    iq_l = apply_rotary(gemma_rms_norm(x["iq"], x["iq_norm_w"], eps), cos, sin)
    ik_l = apply_rotary(gemma_rms_norm(x["ik"], x["ik_norm_w"], eps), cos, sin)
    write_cache_ref(kv[0], k_l, sl)
    write_cache_ref(kv[1], x["v"], sl)
    write_cache_ref(idx, ik_l[:, 0], sl)
    assert torch.equal(q, q_l) and torch.equal(iq, iq_l)
    assert torch.equal(x["kv_cache"], kv) and torch.equal(x["index_cache"], idx)
    assert kv[0].abs().sum() > 0 and idx.abs().sum() > 0  # the writes really happened


@pytest.mark.parametrize("dtype,sparse", [(torch.float32, True), (torch.bfloat16, True),
                                          (torch.bfloat16, False)])
def test_kernel_matches_ref(dtype, sparse):
    x = make_inputs(**TINY, dtype=dtype, device="cpu", sparse=sparse)
    ((q1, iq1), a), ((q2, iq2), b) = run_both(qk_norm_rope_cache, x)
    # bf16 (the real dtype) is bit-exact: same rounding order as the layer. fp32 differs by a few
    # ulp (the sum of squares is reduced in another order, then nothing rounds it away)
    if dtype == torch.bfloat16:
        check = torch.equal
    else:
        def check(u, v):
            torch.testing.assert_close(u, v, atol=1e-6, rtol=1e-5)
            return True
    assert check(q1, q2) and check(a["kv_cache"], b["kv_cache"])
    if sparse:
        assert check(iq1, iq2) and check(a["index_cache"], b["index_cache"])
    else:
        assert iq1 is None
    # padding slots stay untouched: tokens 1 and 6 of 7 are padding, so 5 slots written per plane
    written = (a["kv_cache"][1].reshape(-1, TINY["G"] * TINY["D"]) != 0).any(-1).sum().item()
    assert written == 5


def test_kernel_fp8_cache_exact():
    x = make_inputs(**TINY, dtype=torch.bfloat16, device="cpu", cache_dtype=torch.float8_e4m3fn,
                    fused_views=False)
    kw = dict(k_scale=torch.tensor([0.05]), v_scale=0.1)
    (_, a), (_, b) = run_both(qk_norm_rope_cache, x, **kw)
    # fp8 bytes (scaled K and V, plain-cast index K) are identical to the reference's
    for name in ("kv_cache", "index_cache"):
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))
    assert (a["kv_cache"][0].view(torch.uint8) != 0).sum() > 0


def test_bad_shape_raises():
    x = make_inputs(**TINY, dtype=torch.float32, device="cpu")
    x["k"] = x["k"][:, :1]
    with pytest.raises(ValueError, match="k"):
        qk_norm_rope_cache(**x)


@pytest.mark.parametrize("sparse", [True, False])
def test_launcher_graph_safe(sparse, monkeypatch):
    x = make_inputs(**TINY, dtype=torch.bfloat16, device="cpu", sparse=sparse,
                    cache_dtype=torch.float8_e4m3fn)
    kw = dict(k_scale=torch.tensor([0.05]), v_scale=0.1)  # a host float: no device copy
    guard = HostSyncGuard(monkeypatch)
    guard.patch_kernels(monkeypatch, qk_mod, "_qk_norm_rope_kernel")
    ((q1, iq1), a), ((q2, iq2), b) = run_both(lambda **k: guard.run(qk_norm_rope_cache, **k),
                                              x, **kw)
    # only the q_out (+ iq_out) allocations and one launch
    assert guard.ops == (["empty", "empty"] if sparse else ["empty"])
    assert len(guard.launches) == 1
    assert torch.equal(q1, q2)
    assert torch.equal(a["kv_cache"].view(torch.uint8), b["kv_cache"].view(torch.uint8))


def test_compiles_for_hopper(tmp_path):
    """The job kinds used to meet in one run-time if/else with differently shaped tiles, which
    compiled Triton rejects; compile every variant the layers use for sm_90."""
    ptrs = ["q_ptr", "k_ptr", "v_ptr", "iq_ptr", "ik_ptr", "qw_ptr", "kw_ptr", "iqw_ptr",
            "ikw_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "iqo_ptr"]

    def job(D, Hq, G, Hi, half, cache, sparse, k_scale=0, v_scale=0):
        sig = {p: "*bf16" for p in ptrs}
        sig.update(kv_ptr=f"*{cache}", idx_ptr=f"*{cache}", slot_ptr="*i64", ks_ptr="*fp32",
                   vs_ptr="*fp32", ks_val="fp32", vs_val="fp32", eps="fp32", plane_stride="i64")
        consts = dict(D=D, DI=D, HALF=half, QH=min(16, Hq), KH=G, IH=Hi, BLOCK_D=D, BLOCK_DI=D,
                      HAS_INDEX=sparse, K_SCALE=k_scale, V_SCALE=v_scale, EMULATE=False)
        return ("m3serve.kernels.qk_norm_rope", "_qk_norm_rope_kernel", sig, consts, 4)
    jobs = [job(128, 64, 4, 4, 32, "bf16", True), job(128, 64, 4, 4, 32, "bf16", False),
            job(128, 64, 4, 4, 32, "fp8e4nv", True, 1, 2), job(32, 4, 2, 2, 8, "bf16", True),
            job(32, 4, 2, 2, 8, "fp8e4nv", False, 2, 1)]
    assert len(compile_for_hopper(jobs, tmp_path)) == len(jobs)


def test_bad_scale_raises():
    x = make_inputs(**TINY, dtype=torch.bfloat16, device="cpu", cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        qk_norm_rope_cache(**x, k_scale=torch.tensor([0.05], dtype=torch.float64))
