"""Online-FP8 linears at decode and verify rows (1-16): y = (e4m3(x / s) @ w^T) * s * w_scale,
s the per-token scale of `fused_moe.quant_rows_fp8`, w_scale per output channel -- the numerics
of `layers/quant.fp8_linear` (the same quantised operands), in three launches:

1. `quant_rows_fp8`: x [M, K] -> e4m3 [M, K] and s [M];
2. split-K product: programs over (N tiles, K slices), each widening its e4m3 operands to bf16
   in registers (exact, as are their products) for the MMA and writing its fp32 partial sums to
   a workspace [S, M, N] -- enough programs to stream a TP rank's narrow weights (a fused qkv of
   1,232 rows has 20 column tiles: one program each leaves most of the GPU idle);
3. reduce: the S partials summed in slice order, times s and w_scale, rounded once.

Why: cuBLAS's `_scaled_mm` takes 18.4 us for one TP 8 rank's fused qkv at 1-16 rows against
6.9 us for the same product in bf16; this path 11.2 us (H100, in CUDA graphs,
scripts/fp8_linear_bench.py). It loses where the weight is wide and K short (o_proj: 10.0
against 8.0 us) and at full width, and its rank-level effect was not clear in one lease, so it
is opt-in (`M3SERVE_FP8_DECODE_GEMM=1`) and then taken only for N <= 4096, K >= 4096
(docs/performance.md). CUDA-graph safe: no host sync; the workspace is an ordinary allocation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.rmsnorm import cast_rne, interpreting

MAX_ROWS = 16          # decode and verify rows this path takes (larger: quant + _scaled_mm)
MAX_N, MIN_K = 4096, 4096   # the weights it measured faster for (a TP rank's fused qkv)
_TARGET_PROGRAMS = 264  # about two per SM of an H100 / H200


@triton.jit
def _fp8_splitk_kernel(xq_ptr, w_ptr, part_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EMULATE: tl.constexpr):
    """part[pid_k, m, n] = sum over this program's K slice of xq[m, k] * w[n, k] (fp32)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_ptrs = xq_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]                 # [BM, BK]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]    # [BN, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + offs_k) < k_hi
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if EMULATE:                       # the interpreter's 16-bit dot is not exact
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)        # [BM, BN]
    part_ptrs = part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
    tl.store(part_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_reduce_kernel(part_ptr, xs_ptr, ws_ptr, out_ptr, M, N, S, stride_om,
                       BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    """out[m, n] = round((sum over s of part[s, m, n]) * xs[m] * ws[n]), the slices in order."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=ok, other=0.0)
    ws = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    y = acc * tl.load(xs_ptr + m) * ws
    tl.store(out_ptr + m * stride_om + offs, cast_rne(y, out_ptr.dtype.element_ty, EMULATE), mask=ok)


def fp8_decode_config(N: int, K: int) -> dict:
    """Tiles and K slices by shape: 64-column tiles, 256-deep K steps (128 for short K), as many
    K slices as bring the programs to about two per SM."""
    block_n, block_k = 64, (256 if K >= 2048 else 128)
    tiles, k_blocks = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    splits = max(1, min(k_blocks, triton.cdiv(_TARGET_PROGRAMS, tiles)))
    per = triton.cdiv(k_blocks, splits) * block_k
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "k_per_split": per, "num_warps": 4, "num_stages": 3}


def fp8_decode_eligible(x: torch.Tensor, wq: torch.Tensor) -> bool:
    """1..MAX_ROWS rows of bf16, fp16 or fp32 activations against an e4m3 weight [N, K], unit last
    strides (what the kernel can take; `fp8_decode_chosen` adds where it measured faster)."""
    return (x.dim() == 2 and wq.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.shape[1] == wq.shape[1] and wq.dtype == torch.float8_e4m3fn
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.stride(-1) == 1 and wq.stride(-1) == 1)


def fp8_decode_chosen(x: torch.Tensor, wq: torch.Tensor) -> bool:
    """Whether the opted-in path takes this product: eligible, and a weight of the shape it
    measured faster for (N <= MAX_N, K >= MIN_K)."""
    return wq.shape[0] <= MAX_N and wq.shape[1] >= MIN_K and fp8_decode_eligible(x, wq)


def fp8_decode_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                      config: dict | None = None, x_quant: tuple | None = None) -> torch.Tensor:
    """x [M <= 16, K] bf16/fp16/fp32, wq [N, K] e4m3, w_scale [N] fp32 -> [M, N] in x's dtype (see the
    module docstring). `config` overrides `fp8_decode_config` (benchmarks, tests); `x_quant`:
    x's per-token FP8 form when the caller has it (step 1 is then skipped)."""
    from m3serve.kernels.fused_moe import quant_rows_fp8
    if not fp8_decode_eligible(x, wq) or w_scale.shape != (wq.shape[0],):
        raise ValueError(f"the FP8 decode GEMM needs x [1..{MAX_ROWS}, K] of floats, wq [N, K] e4m3 and "
                         f"w_scale [N] with unit last strides; got {tuple(x.shape)} {x.dtype}, "
                         f"{tuple(wq.shape)} {wq.dtype}, w_scale {tuple(w_scale.shape)}")
    M, K = x.shape
    N = wq.shape[0]
    cfg = dict(config or fp8_decode_config(N, K))
    per = cfg.pop("k_per_split")
    splits = triton.cdiv(K, per)
    xq, xs = x_quant if x_quant is not None else quant_rows_fp8(x)                 # [M, K], [M]
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    emulate = interpreting()
    _fp8_splitk_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), splits)](
        xq, wq, part, M, N, K, per, xq.stride(0), wq.stride(0), BLOCK_M=16, EMULATE=emulate, **cfg)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block = 1024
    _fp8_reduce_kernel[(M, triton.cdiv(N, block))](
        part, xs, w_scale.float(), out, M, N, splits, out.stride(0), BLOCK=block, EMULATE=emulate,
        num_warps=4)
    return out
