"""Times the online-FP8 linear at decode rows on a GPU: per-token quantisation + torch._scaled_mm
against the skinny FP8 GEMM (its quantisation fused; default tiles and a few others) and cuBLAS
bf16, at a TP rank's fused qkv and o_proj and the full widths. One JSON line per shape and rows.
  python scripts/fp8_linear_bench.py"""
import json

import torch

from m3serve.kernels.fused_moe import quant_rows_fp8
from m3serve.kernels.gemv import skinny_fp8_config, skinny_fp8_linear
from m3serve.layers.quant import quantize_weight


def timed(fn, reps=200):
    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps // 20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1e3 / reps, 2)          # µs per call


def main():
    shapes = {"qkv_tp8": (1232, 6144), "o_tp8": (6144, 1024), "qkv_tp4": (2464, 6144),
              "o_tp4": (6144, 2048), "qkv_full": (9856, 6144), "o_full": (6144, 8192)}
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).bfloat16()
        wq, ws = quantize_weight(w)
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda").bfloat16()

            def scaled():
                xq, xs = quant_rows_fp8(x)
                return torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=x.dtype)
            row = {"shape": name, "n": n, "k": k, "m": m, "scaled_mm_us": timed(scaled),
                   "bf16_cublas_us": timed(lambda: torch.nn.functional.linear(x, w)),
                   "skinny_fp8_us": timed(lambda: skinny_fp8_linear(x, wq, ws)),
                   "default": skinny_fp8_config(n, k)}
            for bn, bk, stages in ((16, 256, 4), (32, 256, 4), (64, 128, 4), (32, 512, 3), (128, 128, 4)):
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": stages}
                row[f"n{bn}k{bk}s{stages}"] = timed(lambda: skinny_fp8_linear(x, wq, ws, cfg))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
