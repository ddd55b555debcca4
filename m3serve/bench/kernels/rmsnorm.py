"""Micro-benchmark of the Triton Gemma RMSNorm and fused residual-add + RMSNorm on a GPU at
MiniMax-M3's hidden size 6144 (8192-token prefill and a 64-token decode batch), bf16. Prints
TB/s over bytes moved (rows read + written) vs the H200's 4.19 TB/s.

Run: python -m m3serve.bench.kernels.rmsnorm
"""
from __future__ import annotations

import torch

from m3serve.bench.roofline import HBM_READ_TBPS

HIDDEN = 6144


def main() -> None:
    import triton.testing

    from m3serve.kernels.rmsnorm import fused_add_rms_norm, rms_norm
    w = torch.zeros(HIDDEN, device="cuda", dtype=torch.bfloat16)
    for rows in (8192, 64):
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        row_bytes = rows * HIDDEN * 2
        cases = (("rms_norm", lambda x=x: rms_norm(x, w, 1e-6), 2 * row_bytes),
                 ("fused_add_rms_norm", lambda x=x, r=r: fused_add_rms_norm(x, r, w, 1e-6),
                  4 * row_bytes))
        for name, fn, nbytes in cases:
            ms = triton.testing.do_bench(fn)
            tbs = nbytes / (ms * 1e-3) / 1e12
            print(f"{name:<20} [{rows}, {HIDDEN}] {ms * 1e3:8.1f} us  {tbs:5.2f} TB/s "
                  f"({tbs / HBM_READ_TBPS:5.1%})")


if __name__ == "__main__":
    main()
