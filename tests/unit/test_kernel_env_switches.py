"""The A/B switches of the decode kernels read from the environment at import:
M3SERVE_ROUTE_ALIGN_MAX_TOKENS sets the batch size up to which the MoE layer routes and aligns
in one launch (`kernels/fused_moe.ROUTE_ALIGN_MAX_TOKENS`), M3SERVE_SPLIT_MERGE_IN_KERNEL turns
on the attention kernel's own split merge (`envs.SPLIT_MERGE_IN_KERNEL`),
M3SERVE_ROUTE_TENSOR_CORES=0 turns off the tensor-core router logits of long prompt steps
(`envs.ROUTE_TENSOR_CORES`), M3SERVE_PDL=1 programmatic dependent launch (`envs.PDL`); bad values
are refused by name."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRINT = ("from m3serve import envs; from m3serve.kernels import fused_moe as fm; "
         "print(fm.ROUTE_ALIGN_MAX_TOKENS, envs.SPLIT_MERGE_IN_KERNEL, envs.ROUTE_TENSOR_CORES, envs.PDL)")
SWITCHES = ("M3SERVE_ROUTE_ALIGN_MAX_TOKENS", "M3SERVE_SPLIT_MERGE_IN_KERNEL", "M3SERVE_ROUTE_TENSOR_CORES",
            "M3SERVE_PDL")


def _read(**env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in SWITCHES}
    return subprocess.run([sys.executable, "-c", PRINT], env={**base, **env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120, check=False)


def test_defaults_and_overrides():
    assert _read().stdout.split() == ["8", "False", "True", "False"]
    got = _read(M3SERVE_ROUTE_ALIGN_MAX_TOKENS="16", M3SERVE_SPLIT_MERGE_IN_KERNEL="1",
                M3SERVE_ROUTE_TENSOR_CORES="0", M3SERVE_PDL="1")
    assert got.stdout.split() == ["16", "True", "False", "True"], got.stderr[-2000:]
    assert _read(M3SERVE_ROUTE_ALIGN_MAX_TOKENS="0").stdout.split() == ["0", "False", "True", "False"]


@pytest.mark.parametrize("name,value,message", [
    ("M3SERVE_ROUTE_ALIGN_MAX_TOKENS", "17", "token count from 0 to 16, got '17'"),
    ("M3SERVE_ROUTE_ALIGN_MAX_TOKENS", "four", "token count from 0 to 16, got 'four'"),
    ("M3SERVE_SPLIT_MERGE_IN_KERNEL", "yes", "must be 0 or 1, got 'yes'"),
    ("M3SERVE_ROUTE_TENSOR_CORES", "on", "must be 0 or 1, got 'on'"),
    ("M3SERVE_PDL", "true", "must be 0 or 1, got 'true'"),
])
def test_bad_values_are_refused_by_name(name, value, message):
    got = _read(**{name: value})
    assert got.returncode != 0 and name in got.stderr and message in got.stderr
