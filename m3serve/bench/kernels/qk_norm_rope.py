"""Micro-benchmark of the fused QK norm + RoPE + cache-write kernel on a GPU at MiniMax-M3 shapes
(64 q heads, 4 KV heads, D 128, 4 index heads + 1 index key head, rotary 64) for batch-1 and
batch-64 decode steps and an 8K-token prefill, sparse and dense layers. Times each eagerly (host
launch overhead included) and replayed from a CUDA graph (GPU time), and prints the graph TB/s
over bytes moved (inputs read + outputs and cache rows written) vs the H200's 4.19 TB/s.

Run: python -m m3serve.bench.kernels.qk_norm_rope [--fp8]
"""
from __future__ import annotations

import argparse

import torch

from m3serve.bench.kernels import graph_ms
from m3serve.bench.roofline import HBM_READ_TBPS

HQ, G, D, HI, DI, HALF, BS = 64, 4, 128, 4, 128, 32, 128


def _inputs(T: int, sparse: bool, fp8: bool) -> dict:
    dt = torch.bfloat16
    widths = [HQ * D, G * D, G * D] + ([HI * DI, DI] if sparse else [])
    parts = torch.randn(T, sum(widths), device="cuda", dtype=dt).split(widths, dim=-1)
    nb = T // BS + 2
    cdt = torch.float8_e4m3fn if fp8 else dt
    x = dict(q=parts[0].view(T, HQ, D), k=parts[1].view(T, G, D), v=parts[2].view(T, G, D),
             iq=parts[3].view(T, HI, DI) if sparse else None,
             ik=parts[4].view(T, 1, DI) if sparse else None,
             q_norm_w=torch.zeros(D, device="cuda", dtype=dt),
             k_norm_w=torch.zeros(D, device="cuda", dtype=dt),
             iq_norm_w=torch.zeros(DI, device="cuda", dtype=dt) if sparse else None,
             ik_norm_w=torch.zeros(DI, device="cuda", dtype=dt) if sparse else None,
             cos=torch.rand(T, HALF, device="cuda", dtype=dt),
             sin=torch.rand(T, HALF, device="cuda", dtype=dt),
             kv_cache=torch.zeros(2, nb, BS, G, D, device="cuda", dtype=cdt),
             index_cache=torch.zeros(nb, BS, DI, device="cuda", dtype=cdt) if sparse else None,
             slot_mapping=torch.randperm(nb * BS, device="cuda")[:T], eps=1e-6)
    if fp8:
        x["k_scale"] = torch.tensor([0.05], device="cuda")
        x["v_scale"] = torch.tensor([0.05], device="cuda")
    return x


def _bytes(T: int, sparse: bool, fp8: bool) -> int:
    act, cache = 2, (1 if fp8 else 2)
    n = T * ((HQ + 2 * G) * D * act + HQ * D * act + 2 * G * D * cache + 2 * HALF * 2 * act)
    if sparse:
        n += T * ((HI + 1) * DI * act + HI * DI * act + DI * cache)
    return n


def main() -> None:
    import triton.testing

    from m3serve.kernels.qk_norm_rope import qk_norm_rope_cache
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fp8", action="store_true", help="fp8 K/V and index caches")
    args = ap.parse_args()
    for T in (1, 64, 8192):
        for sparse in (True, False):
            x = _inputs(T, sparse, args.fp8)
            ms = triton.testing.do_bench(lambda x=x: qk_norm_rope_cache(**x))
            ms_g = graph_ms(lambda x=x: qk_norm_rope_cache(**x))
            tbs = _bytes(T, sparse, args.fp8) / (ms_g * 1e-3) / 1e12
            print(f"T={T:<5} {'sparse' if sparse else 'dense ':<6} eager {ms * 1e3:8.1f} us  "
                  f"graph {ms_g * 1e3:8.1f} us  {tbs:5.2f} TB/s ({tbs / HBM_READ_TBPS:5.1%})")


if __name__ == "__main__":
    main()
