"""Programmatic dependent launch (kernels/pdl.py): decode kernels compiled for sm_90 with PDL on
carry the grid-dependency instructions (the wait before any memory access, the launch of the
next kernel) and without it none; off by default, and never under the interpreter."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m3serve.kernels import pdl

_SCRIPT = """
import importlib, json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
for mod, name, sig, consts, warps in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module(mod), name)
    full = {n: "i32" for n in fn.arg_names}
    full.update(sig)
    full.update({c: "constexpr" for c in consts})
    ptx = triton.compile(triton.compiler.ASTSource(fn=fn, signature=full, constexprs=consts),
                         target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["ptx"]
    # the wait must come before the kernel's first memory access
    body = ptx[ptx.index("griddepcontrol.wait"):] if "griddepcontrol.wait" in ptx else ""
    head = ptx[:len(ptx) - len(body)] if body else ""
    early = any(op in head for op in ("ld.global", "st.global", "atom.", "red.", "cp.async", "ld.shared"))
    print("compiled", name, consts["PDL"], "griddepcontrol.wait" in ptx,
          "griddepcontrol.launch_dependents" in ptx, not early, flush=True)
"""

# kernel -> (pointer types, constexprs): the decode layer's chain
_JOBS = {
    ("rmsnorm", "_rms_norm_kernel"): ({"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                                       "res_out_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                                       "eps": "fp32", "min_scale": "fp32"},
                                      {"HAS_RESIDUAL": True, "BLOCK": 8192, "EMULATE": False}),
    ("indexer", "_topk_rows_kernel"): ({"score_ptr": "*fp32", "out_ptr": "*i32", "ntok_ptr": "*i32",
                                        "nvis_ptr": "*i32"},
                                       {"TOPK": 16, "TOPK_P": 16, "CHUNK": 128, "ONE_CHUNK": True,
                                        "HAS_NTOK": True, "HAS_NVIS": True}),
    ("fused_moe", "_quant_rows_kernel"): ({"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                                          "min_scale": "fp32"}, {"BLOCK": 8192, "SOFT_ROUND": False}),
    ("swiglu", "_swiglu_kernel"): ({"x_ptr": "*bf16", "out_ptr": "*bf16", "alpha": "fp32", "limit": "fp32"},
                                   {"BLOCK": 1024, "EMULATE": False}),
}


def test_off_by_default_and_never_under_the_interpreter(monkeypatch):
    from types import SimpleNamespace
    from m3serve import envs
    assert envs.PDL is False or os.environ.get("M3SERVE_PDL") == "1"
    monkeypatch.setattr(envs, "PDL", True)
    assert not pdl.enabled(torch.zeros(1))                      # a CPU tensor
    # a CUDA tensor on a Hopper device, as far as `enabled` can tell
    monkeypatch.setattr(pdl, "SUPPORTED", True)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    cuda_like = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pdl.enabled(cuda_like)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(cuda_like)
    monkeypatch.setattr(envs, "PDL", False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not pdl.enabled(cuda_like)
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}


def test_decode_kernels_compile_with_the_grid_dependency_instructions(tmp_path):
    import triton
    if not pdl.SUPPORTED:
        pytest.skip("this Triton has no programmatic dependent launch")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no bundled ptxas")
    jobs = []
    for (mod, name), (sig, consts) in _JOBS.items():
        fn = getattr(__import__(f"m3serve.kernels.{mod}", fromlist=[name]), name)
        names = set(fn.arg_names)
        for on in (False, True):
            jobs.append([f"m3serve.kernels.{mod}", name, {k: v for k, v in sig.items() if k in names},
                         {**consts, "PDL": on}, 4])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(jobs)], env=env, capture_output=True,
                       text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("compiled")]
    assert len(lines) == 2 * len(_JOBS)
    for _, name, on, wait, launch, wait_first in lines:
        assert wait == launch == on, (name, on, wait, launch)
        assert wait_first == "True", name          # no memory access before the wait
