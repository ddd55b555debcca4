"""Times the online-FP8 linear at decode rows on a GPU, in CUDA graphs: per-token quantisation +
torch._scaled_mm against the split-K FP8 GEMM (kernels/fp8_decode.py; its default config and a
few others) and cuBLAS bf16, at a TP rank's fused qkv and o_proj and the full widths. One JSON
line per shape and row count.   python scripts/fp8_linear_bench.py"""
import json

import torch

from m3serve.kernels.fp8_decode import fp8_decode_config, fp8_decode_linear
from m3serve.kernels.fused_moe import quant_rows_fp8
from m3serve.layers.quant import quantize_weight


def timed(fn, reps=200):
    """Mean µs per call of `fn`, 20 calls per captured graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
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
    return round(start.elapsed_time(end) * 1e3 / reps, 2)


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
                return torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :],
                                        out_dtype=x.dtype)
            default = fp8_decode_config(n, k)
            row = {"shape": name, "n": n, "k": k, "m": m, "scaled_mm_us": timed(scaled),
                   "bf16_cublas_us": timed(lambda: torch.nn.functional.linear(x, w)),
                   "quant_only_us": timed(lambda: quant_rows_fp8(x)),
                   "fp8_decode_us": timed(lambda: fp8_decode_linear(x, wq, ws)), "default": default}
            for bn, bk, per_blocks, stages in ((32, 256, 2, 3), (64, 128, 4, 3), (64, 256, 1, 3),
                                               (128, 128, 2, 3), (64, 256, 4, 4)):
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "k_per_split": bk * per_blocks, "num_warps": 4,
                       "num_stages": stages}
                row[f"n{bn}k{bk}x{per_blocks}s{stages}"] = timed(lambda: fp8_decode_linear(x, wq, ws, cfg))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
