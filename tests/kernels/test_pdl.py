"""Programmatic dependent launch (kernels/pdl.py): decode kernels compiled for sm_90 with PDL on
carry the grid-dependency instructions (the wait before any memory access, the launch of the
next kernel) and without it none; off by default, and never under the interpreter."""
import os

import pytest
import torch

from m3serve.kernels import pdl

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


def _wait_first(ptx: str) -> bool:
    """No memory access in the PTX before `griddepcontrol.wait`."""
    head = ptx[:ptx.index("griddepcontrol.wait")]
    return not any(op in head for op in ("ld.global", "st.global", "atom.", "red.", "cp.async", "ld.shared"))


def test_decode_kernels_compile_with_the_grid_dependency_instructions(tmp_path):
    from test_rmsnorm import compile_ptx_for_hopper
    if not pdl.SUPPORTED:
        pytest.skip("this Triton has no programmatic dependent launch")
    jobs = []
    for (mod, name), (sig, consts) in _JOBS.items():
        fn = getattr(__import__(f"m3serve.kernels.{mod}", fromlist=[name]), name)
        names = set(fn.arg_names)
        for on in (False, True):
            jobs.append([f"m3serve.kernels.{mod}", name, {k: v for k, v in sig.items() if k in names},
                         {**consts, "PDL": on}, 4])
    compiled = compile_ptx_for_hopper(jobs, tmp_path)
    assert len(compiled) == 2 * len(_JOBS)
    for (name, ptx), job in zip(compiled, jobs):
        on = job[3]["PDL"]
        wait, launch = "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx
        assert wait == launch == on, (name, on, wait, launch)
        assert not on or _wait_first(ptx), name          # no memory access before the wait
