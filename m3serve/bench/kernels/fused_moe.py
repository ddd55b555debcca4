"""Micro-benchmark of the fused MoE kernel at MiniMax-M3 shapes on one GPU (H=6144, I=3072,
E=128, top-4 + shared expert), bf16 and FP8 per-channel weights, with a random (balanced) router.

Decode rows report achieved HBM TB/s over the bytes of the distinct experts touched plus the
shared expert; prefill rows report TFLOP/s. Run: python -m m3serve.bench.kernels.fused_moe
"""
from __future__ import annotations

import argparse

import torch
from triton.runtime.errors import OutOfResources

from m3serve.bench.roofline import BF16_TFLOPS, FP8_TFLOPS, HBM_READ_TBPS

H, I, E, K = 6144, 3072, 128, 4
PEAK_TFLOPS = {"bf16": BF16_TFLOPS, "fp8": FP8_TFLOPS}
DECODE_TOKENS = (1, 8, 32, 64, 128)
PREFILL_TOKENS = (8192,)
# Candidate tiles for --sweep: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages).
SWEEP = [dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"), c))
         for c in [
             (16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3),
             (16, 32, 256, 1, 4, 5), (32, 64, 128, 4, 4, 4), (64, 64, 64, 8, 4, 4),
             (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3),
             (128, 64, 128, 8, 8, 3)]]


def make_weights() -> dict:
    """{"bf16": ..., "fp8": ...}: each a dict with w13, w2 and the fused_moe keyword args."""
    from m3serve.kernels.ref.fused_moe import quant_weight_fp8
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    shared = (torch.randn(2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02,
              torch.randn(H, I, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02)
    q13 = torch.empty(w13.shape, dtype=torch.float8_e4m3fn, device="cuda")
    q2 = torch.empty(w2.shape, dtype=torch.float8_e4m3fn, device="cuda")
    s13 = torch.empty(E, 2 * I, device="cuda")
    s2 = torch.empty(E, H, device="cuda")
    for e in range(E):  # per expert: fp32 temporaries of the whole stack would take 29 GB
        q13[e], s13[e] = quant_weight_fp8(w13[e])
        q2[e], s2[e] = quant_weight_fp8(w2[e])
    qs13, ss13 = quant_weight_fp8(shared[0])
    qs2, ss2 = quant_weight_fp8(shared[1])
    return {"bf16": {"w13": w13, "w2": w2, "kw": {"shared": shared}},
            "fp8": {"w13": q13, "w2": q2, "kw": {"w13_scale": s13, "w2_scale": s2,
                                                "shared": (qs13, qs2, ss13, ss2)}}}


def _expert_bytes(fmt: str) -> int:
    """Bytes of one expert (w13 + w2, plus the per-row scales for FP8)."""
    params = 3 * I * H
    return params * 2 if fmt == "bf16" else params + (2 * I + H) * 4


def _routing(num_tokens: int):
    from m3serve.kernels.fused_moe import moe_route
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, device="cuda", generator=g, dtype=torch.bfloat16)
    gate = torch.randn(E, H, device="cuda", generator=g)  # random router: choices spread evenly
    bias = torch.zeros(E, device="cuda")
    weights, ids = moe_route(x, gate, bias, K, 2.0)
    return x, weights, ids, (gate, bias)


def _time(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e-3  # seconds


def bench(fmt: str, num_tokens: int, weights: dict, sweep: bool) -> None:
    from m3serve.kernels.fused_moe import fused_moe, moe_route
    w = weights[fmt]
    x, route_w, ids, (gate, bias) = _routing(num_tokens)
    distinct = int(torch.unique(ids).numel())
    decode = num_tokens < 1024

    def run(reduce="atomic", config=None):
        return lambda: fused_moe(x, w["w13"], w["w2"], route_w, ids, reduce=reduce,
                                 config=config, **w["kw"])

    def report(label, seconds):
        if decode:
            moved = (distinct + 1) * _expert_bytes(fmt) + 2 * x.numel() * x.element_size()
            tbps = moved / seconds / 1e12
            perf = f"{tbps:6.2f} TB/s ({100 * tbps / HBM_READ_TBPS:5.1f}% of {HBM_READ_TBPS})"
        else:
            flops = 2 * num_tokens * (K + 1) * 3 * I * H
            tflops = flops / seconds / 1e12
            perf = (f"{tflops:7.1f} TFLOP/s ({100 * tflops / PEAK_TFLOPS[fmt]:5.1f}% of "
                    f"{PEAK_TFLOPS[fmt]:.0f})")
        print(f"{fmt:>4} T={num_tokens:<5} experts={distinct:<3} {label:<34} "
              f"{seconds * 1e6:9.1f} us  {perf}", flush=True)

    report("fused_moe reduce=atomic", _time(run("atomic")))
    report("fused_moe reduce=sum", _time(run("sum")))
    report("moe_route + fused_moe", _time(lambda: fused_moe(
        x, w["w13"], w["w2"], *moe_route(x, gate, bias, K, 2.0), **w["kw"])))
    if sweep:
        for cfg in SWEEP:
            if decode != (cfg["BLOCK_M"] <= 32):
                continue
            try:
                seconds = _time(run("atomic", cfg))
            except OutOfResources as exc:  # over the shared-memory or register limit
                print(f"  skip {cfg}: {exc}")
                continue
            report("cfg " + ",".join(str(v) for v in cfg.values()), seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--formats", default="bf16,fp8")
    parser.add_argument("--decode", default=",".join(map(str, DECODE_TOKENS)))
    parser.add_argument("--prefill", default=",".join(map(str, PREFILL_TOKENS)))
    parser.add_argument("--sweep", action="store_true",
                        help="also time the candidate tile configs (to tune get_config)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fused_moe benchmark needs a CUDA GPU")
    weights = make_weights()
    print(f"device: {torch.cuda.get_device_name()}  H={H} I={I} E={E} top-{K} + shared")
    tokens = [int(t) for t in (args.decode + "," + args.prefill).split(",") if t]
    for fmt in args.formats.split(","):
        for num_tokens in tokens:
            bench(fmt, num_tokens, weights, args.sweep)


if __name__ == "__main__":
    main()
