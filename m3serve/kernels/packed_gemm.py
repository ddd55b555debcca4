"""Matrix products with packed weights (MXFP8, MXFP4, NVFP4 codes plus block scales, layouts in
`kernels/ref/packed.py`): the weight tiles are read as codes and dequantised in registers, then
multiplied with the 16-bit activation as it is (W8A16 / W4A16; Hopper has no FP4 and no MX
tensor-core instructions). The tile loaders here are shared with the fused MoE.

Numerics: each dequantised weight is the reference's `dequantize(...)` rounded to the
activation dtype, bit for bit (for NVFP4 the block scale is divided by, or multiplied with, the
global scale first, then the element is multiplied by it: one rounding in fp32, then one to the
activation dtype), accumulated in fp32 and rounded once. An FP4 tile is read as its even and
odd elements (the low and high nibbles of each byte), multiplied with the activation's even and
odd columns in two products, so no nibble interleaving is needed in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.ref.packed import MX_BLOCK, NVFP4_BLOCK
from m3serve.kernels.rmsnorm import cast_rne, interpreting

# kind -> the FMT constexpr of the kernels (0 is "not packed" in the fused MoE)
PACK_CODES = {"mxfp8": 1, "mxfp4": 2, "nvfp4": 3}
SCALE_BLOCK = {1: MX_BLOCK, 2: MX_BLOCK, 3: NVFP4_BLOCK}


@triton.jit
def _expand_k(s, ROWS: tl.constexpr, REP: tl.constexpr, BN: tl.constexpr):
    """[ROWS, BN] -> [ROWS * REP, BN]: each block scale repeated over its block's rows."""
    s3 = tl.broadcast_to(tl.expand_dims(s, 1), (ROWS, REP, BN))
    return tl.reshape(s3, (ROWS * REP, BN))


@triton.jit
def _fp4_value(c):
    """E2M1 codes (0..15 in an integer tile) -> fp32 value x 2^-14: the three magnitude bits
    become an fp16's low exponent bits and top mantissa bit (codes 0 and 1 are fp16 subnormals,
    which the conversion keeps exactly) and bit 3 its sign. The caller's scale holds the 2^14."""
    c16 = c.to(tl.uint16)
    bits = ((c16 & 7) << 9) | ((c16 & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


def _fp4_ptx(place: tuple[int, int], finish: str, regs: str) -> str:
    """One PTX block over four code bytes in $4: bytes 0-1 and 2-3 spread to the 16-bit halves
    of t0 / t1, then for the low (even) and high (odd) nibbles of each pair the three magnitude
    bits shifted left by place[0] and the sign bit to bit 15 (shift place[1]), then `finish`
    with {out} = $0 / $1 (even pairs), $2 / $3 (odd pairs), {s} = the pair's scale operand when
    scales come two to a register (16-bit: $5 / $6), {a}, {b} = its two when one to a register
    (32-bit: $5, $6 / $7, $8)."""
    lines = ["{", regs, "mov.b32 z, 0;", "prmt.b32 t0, $4, z, 0x4140;", "prmt.b32 t1, $4, z, 0x4342;"]
    for out, (t, odd) in enumerate((("t0", 0), ("t1", 0), ("t0", 1), ("t1", 1))):
        mag, sign = (0x00700070, 0x00800080) if odd else (0x00070007, 0x00080008)
        lines.append(f"and.b32 m, {t}, {mag:#010x}; shl.b32 m, m, {place[0] - 4 * odd}; "
                     f"and.b32 g, {t}, {sign:#010x}; shl.b32 g, g, {place[1] - 4 * odd}; or.b32 m, m, g;")
        hi = int(t == "t1")
        lines.append(finish.format(out=out, s=5 + hi, a=5 + 2 * hi, b=6 + 2 * hi))
    return "\n".join(lines + ["}"])


# MXFP4: each nibble placed in a bf16 (the code's value x 2^-126: magnitude bits at 6..8, codes 0
# and 1 land on bf16 subnormals, kept exactly), times 2^126, then times the pair's bf16 scales:
# two packed products that round nothing (`mul.rn.bf16x2`, sm_90)
_MXFP4_BF16_PTX = tl.constexpr(_fp4_ptx(
    (6, 12), "mul.rn.bf16x2 m, m, k; mul.rn.bf16x2 ${out}, m, ${s};",
    ".reg .b32 t0, t1, m, g, k, z; mov.b32 k, 0x7E807E80;"))
# FP4 with fp32 scales: each nibble placed in an fp16 (the value x 2^-14, exact, subnormals
# included), widened to fp32, times its scale, the pair rounded once to bf16
_FP4_SCALED_BF16_PTX = tl.constexpr(_fp4_ptx(
    (9, 12), "mov.b32 {{l, h}}, m; cvt.f32.f16 a, l; cvt.f32.f16 b, h; mov.b32 x, ${a}; "
             "mov.b32 y, ${b}; mul.rn.f32 a, a, x; mul.rn.f32 b, b, y; cvt.rn.bf16x2.f32 ${out}, b, a;",
    ".reg .b32 t0, t1, m, g, z; .reg .b16 l, h; .reg .f32 a, b, x, y;"))


@triton.jit
def _mxfp4_bf16(c, s):
    """MXFP4 code bytes c (the even element in the low nibble) and bf16 block scales s =
    2^(e - 127), same shape -> the (even, odd) weights in bf16, exactly the reference's values
    (`_MXFP4_BF16_PTX`, four bytes per block). GPU only (inline PTX)."""
    return tl.inline_asm_elementwise(
        asm=_MXFP4_BF16_PTX, constraints="=r,=r,=r,=r,r,r,r", args=[c, s],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _fp4_scaled_bf16(c, s):
    """FP4 code bytes c and fp32 scales s (the block scale x 2^14), same shape -> the (even,
    odd) weights rounded once to bf16 from the fp32 product, as the reference rounds them
    (`_FP4_SCALED_BF16_PTX`, four bytes per block). GPU only (inline PTX)."""
    return tl.inline_asm_elementwise(
        asm=_FP4_SCALED_BF16_PTX, constraints="=r,=r,=r,=r,r,r,r,r,r", args=[c, s],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def mxfp8_tile(w_base, s_base, stride_n, stride_sn, offs_n, n_ok, k0, K,
               BK: tl.constexpr, BN: tl.constexpr, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """Dequantised MXFP8 weight tile [BK, BN] (rows k0.., columns offs_n) in DTYPE: e4m3 codes
    at w_base [N, K] times 2^(e - 127) from the E8M0 bytes at s_base [N, K/32] (byte 0, whose
    2^-127 is below fp32's normal range, reads as 0). k0 and K are multiples of 32."""
    offs_k = k0 + tl.arange(0, BK)
    n64 = offs_n[None, :].to(tl.int64)
    q = tl.load(w_base + n64 * stride_n + offs_k[:, None],
                mask=(offs_k < K)[:, None] & n_ok[None, :], other=0.0)
    offs_b = k0 // 32 + tl.arange(0, BK // 32)
    e = tl.load(s_base + n64 * stride_sn + offs_b[:, None],
                mask=(offs_b < K // 32)[:, None] & n_ok[None, :], other=0)
    s = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return cast_rne(q.to(tl.float32) * _expand_k(s, BK // 32, 32, BN), DTYPE, EMULATE)


@triton.jit
def fp4_tiles(w_base, s_base, g_base, stride_n, stride_sn, offs_n, n_ok, k0, K,
              BK: tl.constexpr, BN: tl.constexpr, NV: tl.constexpr, GDIV: tl.constexpr,
              DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """Dequantised FP4 weight elements k0 + 2j (even) and k0 + 2j + 1 (odd), j < BK/2, as two
    [BK/2, BN] tiles in DTYPE. Codes: bytes at w_base [N, K/2], the even element in the low
    nibble. NV=False: MXFP4, E8M0 scales at s_base [N, K/32]; NV=True: NVFP4, e4m3 scales at
    s_base [N, K/16] and one fp32 global scale per row at g_base [N] that divides the block
    scale (GDIV) or multiplies it. k0 is a multiple of BK, BK and K of the scale block."""
    SB: tl.constexpr = 16 if NV else 32
    n64 = offs_n[None, :].to(tl.int64)
    offs_j = k0 // 2 + tl.arange(0, BK // 2)
    c = tl.load(w_base + n64 * stride_n + offs_j[:, None],
                mask=(offs_j < K // 2)[:, None] & n_ok[None, :], other=0)
    offs_b = k0 // SB + tl.arange(0, BK // SB)
    raw = tl.load(s_base + n64 * stride_sn + offs_b[:, None],
                  mask=(offs_b < K // SB)[:, None] & n_ok[None, :], other=0.0)
    if not NV and not EMULATE and DTYPE == tl.bfloat16:
        s16 = (raw.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)       # 2^(e - 127); byte 0: 0
        return _mxfp4_bf16(c, _expand_k(s16, BK // SB, SB // 2, BN))
    if NV:
        g = tl.load(g_base + offs_n, mask=n_ok, other=1.0)
        s = raw.to(tl.float32)
        if GDIV:
            s = tl.math.div_rn(s, tl.broadcast_to(g[None, :], (BK // SB, BN)))
        else:
            s = s * g[None, :]
        s = s * 16384.0
    else:
        s = ((raw.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)   # 2^(e - 127) x 2^14
    s = _expand_k(s, BK // SB, SB // 2, BN)
    if not EMULATE and DTYPE == tl.bfloat16:
        return _fp4_scaled_bf16(c, s)
    even = cast_rne(_fp4_value(c & 15) * s, DTYPE, EMULATE)
    odd = cast_rne(_fp4_value(c >> 4) * s, DTYPE, EMULATE)
    return even, odd


@triton.jit
def even_odd_columns(rows, row_ok, k0, K, BK: tl.constexpr):
    """Columns k0 + 2j and k0 + 2j + 1 (j < BK/2) of the 16-bit rows at `rows` ([BM, 1]
    pointers; rows not `row_ok` and columns past K read as 0), as two [BM, BK/2] tiles: the
    operands an FP4 tile's even and odd elements multiply. One contiguous load, split in
    registers (two strided loads would not vectorise)."""
    offs = k0 + tl.arange(0, BK)
    a = tl.load(rows + offs[None, :], mask=row_ok[:, None] & (offs < K)[None, :], other=0.0)
    return tl.split(tl.reshape(a, (a.shape[0], BK // 2, 2)))


@triton.jit(do_not_specialize=["M"])
def _packed_matmul_kernel(x_ptr, w_ptr, s_ptr, g_ptr, out_ptr, M, N, K,
                          stride_xm, stride_wn, stride_sn, stride_om,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          FMT: tl.constexpr, GDIV: tl.constexpr, UPCAST: tl.constexpr,
                          N_FIRST: tl.constexpr):
    """out [M, N] = x [M, K] @ dequant(w)^T, fp32 accumulation rounded once to out's dtype.
    N_FIRST: the grid's first axis (the one launched fastest) walks the column tiles."""
    pid_m = tl.program_id(1 if N_FIRST else 0)
    pid_n = tl.program_id(0 if N_FIRST else 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if FMT == 1:
            w = mxfp8_tile(w_ptr, s_ptr, stride_wn, stride_sn, offs_n, n_ok, k0, K,
                           BLOCK_K, BLOCK_N, dtype, UPCAST)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            if UPCAST:                    # the interpreter's 16-bit dot is not exact
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc)
        else:
            even, odd = fp4_tiles(w_ptr, s_ptr, g_ptr, stride_wn, stride_sn, offs_n, n_ok, k0, K,
                                  BLOCK_K, BLOCK_N, FMT == 3, GDIV, dtype, UPCAST)
            a0, a1 = even_odd_columns(x_rows, m_ok, k0, K, BLOCK_K)
            if UPCAST:
                a0 = a0.to(tl.float32)
                a1 = a1.to(tl.float32)
                even = even.to(tl.float32)
                odd = odd.to(tl.float32)
            acc = tl.dot(a0, even, acc)
            acc = tl.dot(a1, odd, acc)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, cast_rne(acc, out_ptr.dtype.element_ty, UPCAST),
             mask=m_ok[:, None] & n_ok[None, :])


def packed_config(M: int, N: int, K: int) -> dict:
    """Tiles by shape. Decode rows (<= 16): 32-column tiles (16 below 2048 columns, for enough
    programs), K steps of 512 over long reductions, else 256: the best of a sweep at one TP 8
    rank's projections on an H200 (scripts/decode_kernels_bench.py rank_packed; e.g. MXFP8
    3072 x 6144 at 1-16 rows: 14.1 µs against 20.2 for 16 x 256 tiles). Prefill: 64-row tiles."""
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    if M <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 16 if N < 2048 else 32,
                "BLOCK_K": 512 if K >= 4096 else min(256, max(32, triton.next_power_of_2(K))),
                "num_warps": 4, "num_stages": 3}
    if M >= 512:     # the sweep's best at 512-8192 rows (below DEQUANT_MIN_ROWS' path takes over)
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": min(64, max(32, triton.next_power_of_2(K))),
                "num_warps": 8, "num_stages": 3, "N_FIRST": True}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": min(128, max(32, triton.next_power_of_2(K))),
            "num_warps": 8, "num_stages": 3}


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMT: tl.constexpr,
                       GDIV: tl.constexpr, UPCAST: tl.constexpr):
    """out [N, K] = the dequantised weight in out's dtype, a [BLOCK_K, BLOCK_N] tile a program
    (the matmul's tile loaders, so the values are the ones its products use)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = offs_n < N
    dtype = out_ptr.dtype.element_ty
    rows = out_ptr + offs_n[None, :].to(tl.int64) * stride_on
    if FMT == 1:
        w = mxfp8_tile(w_ptr, s_ptr, stride_wn, stride_sn, offs_n, n_ok, k0, K, BLOCK_K, BLOCK_N, dtype, UPCAST)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tl.store(rows + offs_k[:, None], w, mask=(offs_k < K)[:, None] & n_ok[None, :])
    else:
        even, odd = fp4_tiles(w_ptr, s_ptr, g_ptr, stride_wn, stride_sn, offs_n, n_ok, k0, K,
                              BLOCK_K, BLOCK_N, FMT == 3, GDIV, dtype, UPCAST)
        offs_k = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        ok = (offs_k < K)[:, None] & n_ok[None, :]
        tl.store(rows + offs_k[:, None], even, mask=ok)
        tl.store(rows + offs_k[:, None] + 1, odd, mask=ok)


# From this many rows a packed product dequantises the weight once into a 16-bit scratch and
# multiplies with cuBLAS: at one TP 8 rank's MXFP8 projections on an H200 the in-register
# products ran 1.4-4x slower than cuBLAS bf16 at 512-8192 rows (docs/performance.md), and the
# dequantisation reads 1 byte and writes 2 per weight element once per product.
DEQUANT_MIN_ROWS = 512


def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None,
                      kind: str, dtype: torch.dtype, global_divides: bool = True) -> torch.Tensor:
    """The packed weight (as `packed_matmul` takes it) dequantised to [N, K] in `dtype`: each
    element the reference's `dequantize(...)` rounded to `dtype`."""
    fmt = PACK_CODES[kind]
    N = codes.shape[0]
    K = codes.shape[1] * (1 if fmt == 1 else 2)
    codes, scales = codes.contiguous(), scales.contiguous()
    g = global_scale.float().contiguous() if fmt == 3 else scales
    out = torch.empty((N, K), dtype=dtype, device=codes.device)
    bn, bk = (16, 32) if interpreting() else (64, 128)
    _dequantize_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
        codes, scales, g, out, N, K, codes.stride(0), scales.stride(0), out.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, FMT=fmt, GDIV=bool(global_divides), UPCAST=interpreting(), num_warps=4)
    return out


def packed_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  global_scale: torch.Tensor | None, kind: str, global_divides: bool = True,
                  config: dict | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ dequant(W)^T -> [M, N] in x's dtype, W held as `kind` codes
    ("mxfp8": e4m3 [N, K]; "mxfp4" / "nvfp4": bytes [N, K/2]) with block scales [N, K/B] and,
    for NVFP4, a per-row fp32 global scale [N] (`global_divides`: compressed-tensors divides
    by it, ModelOpt multiplies). `config` overrides the tiles (benchmarks); its optional
    "N_FIRST" launches the column tiles of a row block together (the activation rows stay in
    L2 while the weight streams), where the default launches a column tile's row blocks together."""
    fmt = PACK_CODES.get(kind)
    if fmt is None:
        raise ValueError(f"unknown packed format {kind!r} ({', '.join(PACK_CODES)})")
    if x.dim() != 2 or codes.dim() != 2:
        raise ValueError(f"x must be [M, K] and codes [N, K'], got {tuple(x.shape)} and {tuple(codes.shape)}")
    M, K = x.shape
    N = codes.shape[0]
    per_byte = 1 if fmt == 1 else 2
    block = SCALE_BLOCK[fmt]
    if codes.shape[1] * per_byte != K or scales.shape != (N, K // block) or K % block:
        raise ValueError(f"{kind} weight codes {tuple(codes.shape)} / scales {tuple(scales.shape)} "
                         f"do not fit x {tuple(x.shape)} (K must be a multiple of {block})")
    if fmt == 3 and (global_scale is None or global_scale.numel() != N):
        raise ValueError(f"nvfp4 needs a global scale per output row ({N})")
    x, codes, scales = x.contiguous(), codes.contiguous(), scales.contiguous()
    g = global_scale.float().contiguous() if fmt == 3 else scales
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if config is None and M >= DEQUANT_MIN_ROWS and x.dtype != torch.float32 and not interpreting():
        w = dequantize_weight(codes, scales, g if fmt == 3 else None, kind, x.dtype, global_divides)
        return torch.mm(x, w.t(), out=out)
    cfg = config or packed_config(M, N, K)
    n_first = bool(cfg.get("N_FIRST", False))
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    grid = grid[::-1] if n_first else grid
    _packed_matmul_kernel[grid](
        x, codes, scales, g, out, M, N, K, x.stride(0), codes.stride(0), scales.stride(0),
        out.stride(0), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        FMT=fmt, GDIV=bool(global_divides), UPCAST=interpreting(), N_FIRST=n_first,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
