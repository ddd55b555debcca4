"""The MXFP8 dense product with FP8 activations (W8A8), an opt-in alternative to the weight-only
`packed_gemm.packed_matmul` for prefill-sized products: the activation rows are quantised to
e4m3 with one fp32 scale per token (`fused_moe.quant_rows_fp8`: row amax / 448), then both
operands go to the FP8 tensor cores as they are, with no dequantisation in registers. Where it
runs is decided by `layers/packed.packed_linear` (M3SERVE_MXFP8_W8A8).

Numerics (`ref/packed.w8a8_reference` is the oracle): every 32-wide K chunk (one E8M0 block of
the weight) is its own e4m3 x e4m3 product accumulated in fp32, multiplied by the block's scale
2^(e - 127) per output column and added to an fp32 accumulator; the token's scale multiplies the
sum at the end, rounded once to the output dtype. A K tile of 128 is four such chunks, loaded
and multiplied one by one, their four scales read in one load. Short chunks also keep the FP8
MMA's own reduced-precision accumulation to 32 products before each fp32 addition. Scale byte 0
reads as 0 (as in `packed_gemm.mxfp8_tile`) and 255 as infinity, where the reference has
2^-127 and NaN: real weights have neither (byte 0 is an all-zero block's, or one below 2^-118).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.ref.packed import MX_BLOCK
from m3serve.kernels.rmsnorm import cast_rne, interpreting


@triton.jit
def _k_tile_scales(s_cols, k0, last, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    """The E8M0 scales of the (up to four) 32-blocks of the K tile at k0 as fp32 2^(e - 127),
    one [BLOCK_N] vector per block (blocks past the tile repeat the last): one [BLOCK_N, CHUNKS]
    load per K tile rather than a gather per block. Block indices past K's last block read
    that block (its products are zero: the codes there are masked to 0)."""
    blocks = tl.minimum(k0 // 32 + tl.arange(0, CHUNKS), last)
    e = tl.load(s_cols[:, None] + blocks[None, :])                        # [BLOCK_N, CHUNKS]
    s = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    if CHUNKS == 1:
        s0 = tl.reshape(s, (BLOCK_N,))
        return s0, s0, s0, s0
    elif CHUNKS == 2:
        s0, s1 = tl.split(s)
        return s0, s1, s1, s1
    else:
        even, odd = tl.split(tl.reshape(s, (BLOCK_N, 2, 2)))              # blocks 0, 2 | 1, 3
        s0, s2 = tl.split(even)
        s1, s3 = tl.split(odd)
        return s0, s1, s2, s3


@triton.jit(do_not_specialize=["M"])
def _mxfp8_w8a8_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K,
                       stride_xm, stride_wn, stride_sn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """out [M, N] = xs[:, None] * sum over 32-chunks c of (xq[:, c] @ w[:, c]^T) * 2^(s[:, c] - 127)."""
    CHUNKS: tl.constexpr = BLOCK_K // 32
    # column tiles vary fastest: the programs in flight share a few activation row blocks and
    # sweep the whole (small, per-rank) weight, which stays in L2
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = xq_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    # columns past N read row N - 1's scales (never stored): no masks on the scale loads
    s_cols = s_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_sn
    last = K // 32 - 1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        s0, s1, s2, s3 = _k_tile_scales(s_cols, k0, last, BLOCK_N, CHUNKS)
        for j in tl.static_range(CHUNKS):
            offs_k = k0 + j * 32 + tl.arange(0, 32)
            if EVEN_K:
                a = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None], other=0.0)
                w = tl.load(w_cols + offs_k[:, None], mask=n_ok[None, :], other=0.0)
            else:                         # K is a multiple of 32: a chunk is all in or all out
                k_ok = offs_k < K
                a = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:                    # the interpreter has no fp8 product; fp32 is exact here
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            s = s0 if j == 0 else (s1 if j == 1 else (s2 if j == 2 else s3))
            acc += tl.dot(a, w) * s[None, :]
    xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
    out = acc * xs[:, None]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, cast_rne(out, out_ptr.dtype.element_ty, UPCAST),
             mask=m_ok[:, None] & n_ok[None, :])


def w8a8_config(M: int, N: int, K: int) -> dict:
    """Tiles by shape: 128 x 128 output tiles (64 rows below 2048, for enough programs at one
    rank's narrow projections), a K step of 128 (four scale blocks). Not yet tuned on a GPU
    (scripts/decode_kernels_bench.py prefill_w8a8 sweeps alternatives)."""
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1}
    bm = 128 if M >= 2048 else 64
    return {"BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": 128 if K >= 128 else 32,
            "num_warps": 8 if bm == 128 else 4, "num_stages": 4}


def _check_weight(codes: torch.Tensor, scales: torch.Tensor, K: int) -> None:
    if codes.dim() != 2 or codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"mxfp8 codes must be float8_e4m3fn [N, K], got {codes.dtype} {tuple(codes.shape)}")
    N = codes.shape[0]
    if codes.shape[1] != K or K % MX_BLOCK or tuple(scales.shape) != (N, K // MX_BLOCK):
        raise ValueError(f"mxfp8 weight codes {tuple(codes.shape)} / scales {tuple(scales.shape)} do "
                         f"not fit an activation of width {K} (K must be a multiple of {MX_BLOCK}, "
                         f"scales [N, K/{MX_BLOCK}])")
    if scales.element_size() != 1:
        raise ValueError(f"mxfp8 block scales must be E8M0 bytes, got {scales.dtype}")


def mxfp8_w8a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, codes: torch.Tensor,
                    scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                    config: dict | None = None) -> torch.Tensor:
    """The GEMM alone: xq e4m3 [M, K] with fp32 row scales x_scale [M], codes e4m3 [N, K],
    E8M0 block scales [N, K/32] (uint8 or float8_e8m0fnu) -> [M, N] in out_dtype. `config`
    overrides the tiles (benchmarks)."""
    if xq.dim() != 2 or xq.dtype != torch.float8_e4m3fn:
        raise ValueError(f"xq must be float8_e4m3fn [M, K], got {xq.dtype} {tuple(xq.shape)}")
    M, K = xq.shape
    _check_weight(codes, scales, K)
    if x_scale.shape != (M,):
        raise ValueError(f"x_scale must hold one scale per row ({M}), got {tuple(x_scale.shape)}")
    N = codes.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M == 0 or N == 0:
        return out
    xq, codes = xq.contiguous(), codes.contiguous()
    scales = scales.contiguous().view(torch.uint8)
    x_scale = x_scale.float().contiguous()
    cfg = config or w8a8_config(M, N, K)
    if cfg["BLOCK_K"] not in (32, 64, 128):
        raise ValueError(f"BLOCK_K must be 32, 64 or 128 (one to four scale blocks), got {cfg['BLOCK_K']}")
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _mxfp8_w8a8_kernel[grid](
        xq, x_scale, codes, scales, out, M, N, K, xq.stride(0), codes.stride(0), scales.stride(0),
        out.stride(0), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        EVEN_K=K % cfg["BLOCK_K"] == 0, UPCAST=interpreting(), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out


def mxfp8_w8a8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      config: dict | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) quantised per token to e4m3, times the MXFP8 weight (codes
    e4m3 [N, K], E8M0 scales [N, K/32]) on the FP8 tensor cores -> [M, N] in x's dtype. Two
    launches: the row quantiser, then `mxfp8_w8a8_gemm`."""
    from m3serve.kernels.fused_moe import quant_rows_fp8
    if x.dim() != 2 or not x.dtype.is_floating_point or x.element_size() < 2:
        raise ValueError(f"x must be a 16- or 32-bit float [M, K], got {x.dtype} {tuple(x.shape)}")
    _check_weight(codes, scales, x.shape[1])
    xq, x_scale = quant_rows_fp8(x.contiguous())                 # [M, K] e4m3, [M] fp32
    return mxfp8_w8a8_gemm(xq, x_scale, codes, scales, x.dtype, config)
