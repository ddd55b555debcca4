"""Router of one MoE layer at the real shapes (128 experts x 6144), decode token counts: the
fused kernels against the torch ops they replace, CUDA-graph-free do_bench times in µs."""
import torch
import triton

from m3serve.kernels.fused_moe import moe_route
from m3serve.layers.moe import route

gate = torch.randn(128, 6144, device="cuda") * 6144 ** -0.5
bias = torch.randn(128, device="cuda") * 0.05
for t in (1, 4, 8, 64, 256):
    x = torch.randn(t, 6144, device="cuda", dtype=torch.bfloat16)
    fused = triton.testing.do_bench_cudagraph(lambda: moe_route(x, gate, bias, 4, 2.5)) * 1e3
    ref = triton.testing.do_bench_cudagraph(lambda: route(x, gate, bias, 4, 2.5)) * 1e3
    print(f"tokens {t}: fused {fused:.1f} us, torch {ref:.1f} us")
