"""CPU interpreter tests of the Triton RMSNorm kernels at tiny shapes, the reference against the
layer op (gemma_rms_norm after a bf16 residual add), host-sync freedom of the launchers, and an
offline sm_90 compile."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels.ref.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref  # noqa: E402
from m3serve.kernels import rmsnorm as rms_mod  # noqa: E402
from m3serve.kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from m3serve.layers.norm import gemma_rms_norm  # noqa: E402
from test_rmsnorm import HostSyncGuard, compile_for_hopper, make_rows  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ref_matches_layer_ops(dtype):
    x, res, w = make_rows(5, 96, dtype, "cpu")
    out, new_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(new_res, x + res)
    assert torch.equal(out, gemma_rms_norm(x + res, w, 1e-6))
    assert torch.equal(rms_norm_ref(x, w, 1e-6), gemma_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_ref(dtype):
    x, res, w = make_rows(6, 80, dtype, "cpu")   # N not a power of two: masked tail
    x = torch.cat([x, x], dim=-1)[:, :80]         # strided rows
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    plain, ref_plain = rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    if dtype == torch.bfloat16:  # bit-exact in the real dtype
        assert torch.equal(out, ref_out) and torch.equal(plain, ref_plain)
    else:  # fp32: only the reduction order differs
        torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(plain, ref_plain, atol=1e-6, rtol=1e-6)
    assert out.shape == x.shape and not torch.equal(out, plain)


def test_3d_input_and_bad_weight():
    x, res, w = make_rows(6, 32, torch.bfloat16, "cpu")
    out = rms_norm(x.view(2, 3, 32), w, 1e-6)
    assert torch.equal(out.view(6, 32), rms_norm_ref(x, w, 1e-6))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:16], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, res[:3], w, 1e-6)


def test_launchers_graph_safe(monkeypatch):
    x, res, w = make_rows(6, 64, torch.bfloat16, "cpu")
    rms_mod._placeholders(x.device)           # the FP8 placeholders are made once per device
    guard = HostSyncGuard(monkeypatch)
    guard.patch_kernels(monkeypatch, rms_mod, "_rms_norm_kernel")
    out = guard.run(rms_norm, x.view(2, 3, 64), w, 1e-6)
    assert guard.ops == ["empty"] and len(guard.launches) == 1
    assert torch.equal(out.view(6, 64), rms_norm_ref(x, w, 1e-6))
    out, new_res = guard.run(fused_add_rms_norm, x, res, w, 1e-6)
    assert guard.ops == ["empty", "empty"] and len(guard.launches) == 1
    assert torch.equal(new_res, fused_add_rms_norm_ref(x, res, w, 1e-6)[1])


def test_compiles_for_hopper(tmp_path):
    def job(N, res, x="*bf16"):
        block = 1 << (N - 1).bit_length()
        sig = {p: "*bf16" for p in ("res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
        sig.update(x_ptr=x, q_ptr="*fp8e4nv", s_ptr="*fp32", eps="fp32", min_scale="fp32")
        return ("m3serve.kernels.rmsnorm", "_rms_norm_kernel", sig,
                dict(HAS_RESIDUAL=res, BLOCK=block, EMULATE=False), 8 if block > 2048 else 4)
    # plain, residual, small; the fp32 sub-layer input (the FP8 form is a run-time flag of each)
    jobs = [job(6144, True), job(6144, False), job(32, True), job(6144, True, x="*fp32")]
    assert len(compile_for_hopper(jobs, tmp_path)) == len(jobs)


def test_fp32_sublayer_output_is_rounded_first():
    """An MoE layer's fp32 sum added to a bf16 residual stream: the kernel rounds it to bf16
    first -- bit-equal to casting it beforehand -- and returns bf16 tensors; a mismatch of
    another kind is refused."""
    x, res, w = make_rows(5, 96, torch.bfloat16, "cpu")
    wide = x.float() + torch.randn(x.shape) * 1e-3          # fp32 values between bf16 ones
    out, new_res = fused_add_rms_norm(wide, res, w, 1e-6)
    want_out, want_res = fused_add_rms_norm(wide.to(torch.bfloat16), res, w, 1e-6)
    assert out.dtype == new_res.dtype == torch.bfloat16
    assert torch.equal(out, want_out) and torch.equal(new_res, want_res)
    with pytest.raises(ValueError, match="does not match"):
        fused_add_rms_norm(x.half(), res, w, 1e-6)


@pytest.mark.parametrize("wide", [False, True])
def test_fp8_form_of_the_normed_rows_equals_quant_rows(wide):
    """`fused_add_rms_norm_fp8`: the normed rows and residual of `fused_add_rms_norm`, and their
    per-token FP8 form bit-equal to `quant_rows_fp8` of the normed rows (a zero row included)."""
    from m3serve.kernels.fused_moe import quant_rows_fp8
    from m3serve.kernels.rmsnorm import fused_add_rms_norm_fp8
    x, res, w = make_rows(6, 96, torch.bfloat16, "cpu")
    x[4], res[4] = 0.0, 0.0
    if wide:
        x = x.float() + torch.randn(x.shape) * 1e-3
    out, new_res, (q, s) = fused_add_rms_norm_fp8(x, res, w, 1e-6)
    want_out, want_res = fused_add_rms_norm(x, res, w, 1e-6)
    want_q, want_s = quant_rows_fp8(want_out)
    assert torch.equal(out, want_out) and torch.equal(new_res, want_res)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.float(), want_q.float()) and torch.equal(s, want_s)
    with pytest.raises(ValueError, match="two dimensions"):
        fused_add_rms_norm_fp8(x[None], res[None], w, 1e-6)
