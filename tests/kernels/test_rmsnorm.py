"""GPU tests of the Triton Gemma RMSNorm / fused residual-add + norm at real M3 widths, plus two
helpers shared by the kernel tests: a host-sync guard (every aten op a launcher's host code runs,
failing on syncs) and an offline sm_90 compile check (a CPU subprocess, no interpreter)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from m3serve.kernels.ref.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref


def make_rows(rows, n, dtype, device, seed=0):
    """x, residual [rows, n] and a Gemma weight [n] (offset from 1)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype).to(device)
    res = (torch.randn(rows, n, generator=g) * 10).to(dtype).to(device)
    w = (torch.randn(n, generator=g) * 0.3).to(dtype).to(device)
    return x, res, w


def assert_nearly_equal(x, y, min_equal=0.99):
    """Recorded GPU tolerance: rsqrt.approx / reduction order flip at most one bf16 ulp, rarely."""
    torch.testing.assert_close(x.float(), y.float(), atol=1e-2, rtol=8e-3)
    assert (x == y).float().mean().item() >= min_equal


class HostSyncGuard(TorchDispatchMode):
    """Records the aten ops run by launcher host code and raises on anything that would make a
    GPU launcher sync with the host or break CUDA-graph capture: .item()/bool()/int() on a
    tensor (aten._local_scalar_dense), nonzero/masked_select/unique, boolean-mask indexing,
    tensors built from Python data (a host -> device copy), and .tolist()/.cpu()/.numpy().
    Kernels are swapped for recorders (`patch_kernels`) that run the real kernel unguarded."""

    FORBIDDEN = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2",
                 "lift_fresh", "repeat_interleave", "argwhere")
    PY_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__",
                  "__index__")
    VIEWS = ("view", "slice", "select", "_reshape_alias", "as_strided", "alias", "unsqueeze",
             "squeeze", "expand", "t", "transpose", "permute", "_unsafe_view")  # no device work

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops, self.views, self.launches, self.active = [], [], [], False
        for name in self.PY_METHODS:
            orig = getattr(torch.Tensor, name)

            def guarded(t, *a, _orig=orig, _name=name, **kw):
                if self.active:
                    raise AssertionError(f"host sync: Tensor.{_name}() in launcher host code")
                return _orig(t, *a, **kw)
            monkeypatch.setattr(torch.Tensor, name, guarded)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active:
            name = func.overloadpacket.__name__
            (self.views if name in self.VIEWS else self.ops).append(name)
            if name in self.FORBIDDEN:
                raise AssertionError(f"host sync / data-dependent shape: aten.{name}")
            if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                       for i in args[1]):
                raise AssertionError("boolean-mask indexing (a nonzero sync)")
        return func(*args, **kwargs)

    def patch_kernels(self, monkeypatch, module, *names):
        """Replace module.<name>[grid](...) kernels with recorders of (name, grid)."""
        guard = self
        for name in names:
            real = getattr(module, name)

            class Recorder:
                def __getitem__(self, grid, _real=real, _name=name):
                    def launch(*a, **kw):
                        guard.launches.append((_name, tuple(grid)))
                        guard.active = False
                        try:
                            with torch.utils._python_dispatch._disable_current_modes():
                                return _real[grid](*a, **kw)
                        finally:
                            guard.active = True
                    return launch
            monkeypatch.setattr(module, name, Recorder())

    def run(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) with the guard armed; returns its result. Afterwards `ops` lists
        the aten ops that may do device work (allocations, copies, math), `views` the rest."""
        self.ops, self.views, self.launches = [], [], []
        with self:
            self.active = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.active = False


_COMPILE_SCRIPT = """
import importlib, json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
for i, (mod, name, sig, consts, warps) in enumerate(json.loads(sys.argv[1])):
    fn = getattr(importlib.import_module(mod), name)
    full = {n: "i32" for n in fn.arg_names}
    full.update(sig)
    full.update({c: "constexpr" for c in consts})
    k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=full, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    with open(os.path.join(sys.argv[2], f"{i}.ptx"), "w") as f:
        f.write(k.asm["ptx"])
    print("compiled", name, flush=True)
"""


def compile_for_hopper(jobs, cache_dir) -> list[str]:
    """Compile Triton kernels for sm_90 on this CPU machine (bundled ptxas) in a subprocess
    without TRITON_INTERPRET. jobs: [(module, kernel, {arg: type}, {constexpr: value}, warps)],
    args not named are i32. Returns one "compiled <kernel> <uses wgmma>" line per job."""
    return [f"compiled {name} {'wgmma' in ptx}" for name, ptx in compile_ptx_for_hopper(jobs, cache_dir)]


def compile_ptx_for_hopper(jobs, cache_dir) -> list[tuple[str, str]]:
    """`compile_for_hopper`'s compiles -> (kernel name, its PTX) per job."""
    import triton
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = Path(cache_dir) / "ptx"
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(jobs), str(out)], env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    names = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("compiled")]
    return [(name, (out / f"{i}.ptx").read_text()) for i, name in enumerate(names)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 8192])
@pytest.mark.parametrize("n", [6144, 128, 3000])
def test_rmsnorm_gpu(rows, n):
    from m3serve.kernels.rmsnorm import fused_add_rms_norm, rms_norm
    x, res, w = make_rows(rows, n, torch.bfloat16, "cuda")
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res)  # the residual add is one rounding: exact
    assert_nearly_equal(out, ref_out)
    assert_nearly_equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


@pytest.mark.gpu
def test_rmsnorm_cuda_graph():
    """Capture fails on any host sync; the replay must see new inputs in the captured buffers."""
    from m3serve.kernels.rmsnorm import fused_add_rms_norm
    x, res, w = make_rows(4, 6144, torch.bfloat16, "cuda")
    x2, res2, _ = make_rows(4, 6144, torch.bfloat16, "cuda", seed=1)
    fused_add_rms_norm(x, res, w, 1e-6)                          # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    x.copy_(x2)
    res.copy_(res2)
    graph.replay()
    ref_out, ref_res = fused_add_rms_norm_ref(x2, res2, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    assert_nearly_equal(out, ref_out)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("wide", [False, True])
def test_fp8_form_of_normed_rows_gpu(rows, wide):
    """`fused_add_rms_norm_fp8` at the model width: the normed rows and residual of
    `fused_add_rms_norm` and their FP8 form equal to `quant_rows_fp8`'s, bit for bit (x bf16, or
    an MoE layer's fp32 sum)."""
    from m3serve.kernels.fused_moe import quant_rows_fp8
    from m3serve.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_fp8
    x, res, w = make_rows(rows, 6144, torch.bfloat16, "cuda")
    if wide:
        x = x.float() + torch.randn(x.shape, device="cuda") * 1e-3
    out, new_res, (q, s) = fused_add_rms_norm_fp8(x, res, w, 1e-6)
    want_out, want_res = fused_add_rms_norm(x, res, w, 1e-6)
    want_q, want_s = quant_rows_fp8(want_out)
    assert torch.equal(out, want_out) and torch.equal(new_res, want_res)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
