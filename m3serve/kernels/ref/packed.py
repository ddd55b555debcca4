"""Block-scaled weight codes (MXFP8, MXFP4, NVFP4): the element codecs, the quantisers that
write them and the dequantiser every packed-weight kernel is checked against.

Layout of one [..., N, K] weight (K = the reduction dimension, blocks run along it):
  MXFP8  codes float8_e4m3fn [..., N, K],   scales E8M0 uint8 [..., N, K/32]
  MXFP4  codes uint8 [..., N, K/2] (element 2k in the low nibble, 2k+1 in the high one),
         scales E8M0 uint8 [..., N, K/32]
  NVFP4  codes as MXFP4, scales float8_e4m3fn [..., N, K/16], and a per-row fp32 global
         scale [..., N] that divides (compressed-tensors) or multiplies (ModelOpt) the product.
E8M0 is an unsigned biased exponent: byte e means 2^(e - 127). E2M1 is sign bit 3, then codes
0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6. Torch only (a kernel's reference lives here).
"""
from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
MX_BLOCK = 32
NVFP4_BLOCK = 16


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 0..15) -> fp32 values. Computed from the bits (exponent bits 2..1,
    mantissa bit 0; exponent 0 is subnormal: 0 or 0.5), with no table to copy to the device,
    so it may run inside a CUDA-graph capture."""
    c = codes.to(torch.int32)
    exp, mant = (c >> 1) & 3, (c & 1).to(torch.float32)
    normal = torch.ldexp(1.0 + 0.5 * mant, exp - 1)
    mag = torch.where(exp == 0, 0.5 * mant, normal)
    return torch.where((c & 8) != 0, -mag, mag)


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest E2M1 code (ties to the even code, |x| > 6 saturates); zero (and values
    that round to it) get code 0, never the negative zero 8."""
    a = x.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
           + (a >= 3.5) + (a > 5.0)).to(torch.uint8)
    sign = ((x < 0) & (mag > 0)).to(torch.uint8) << 3
    return mag | sign


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes uint8 [..., K]; the low nibble is the even element."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., K] (K even) -> uint8 [..., K/2], element 2k in the low nibble."""
    return (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> fp32 2^(e - 127). Byte 255 (NaN in OCP MX) is
    returned as NaN."""
    e = scales.view(torch.uint8).to(torch.int32)
    out = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - E8M0_BIAS)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"reduction width {x.shape[-1]} is not a multiple of the scale block {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def dequantize(fmt: str, codes: torch.Tensor, scales: torch.Tensor,
               global_scale: torch.Tensor | None = None, global_divides: bool = True) -> torch.Tensor:
    """Packed weight -> fp32 [..., N, K]. `fmt`: "mxfp8" | "mxfp4" | "nvfp4"; `global_scale`
    [..., N] (NVFP4 only) divides when `global_divides` (compressed-tensors), else multiplies
    (ModelOpt's weight_scale_2) the block scale, so each element is the E2M1 value times one
    fp32 scale per block (block scale / global, rounded once): the order the GPU kernels
    dequantise in (`kernels/packed_gemm.py`), one division per block rather than per element.
    MX formats: element times block scale is exact in fp32."""
    if fmt == "mxfp8":
        values, block, s = codes.float(), MX_BLOCK, e8m0_to_float(scales)
    elif fmt == "mxfp4":
        values, block, s = e2m1_to_float(unpack_fp4(codes)), MX_BLOCK, e8m0_to_float(scales)
    elif fmt == "nvfp4":
        values, block, s = e2m1_to_float(unpack_fp4(codes)), NVFP4_BLOCK, scales.float()
    else:
        raise ValueError(f"unknown packed format {fmt!r} (mxfp8, mxfp4, nvfp4)")
    if global_scale is not None:          # one scale per block, then one product per element
        g = global_scale.float()[..., None]
        s = s / g if global_divides else s * g
    return (_blocks(values, block) * s[..., None]).flatten(-2)


def w8a8_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The MXFP8 product with FP8 activations (`kernels/mxfp8_w8a8.py`): x [M, K] quantised
    per token to e4m3 and back (scale = max(row amax / 448, 1e-12), fp32: the rule of
    `ref/fused_moe.quant_rows_fp8_ref`), times `dequantize("mxfp8", codes, scales)`^T, both
    operands and the product in `dtype` (fp32; the CPU backend passes fp64) -> [M, N]."""
    from m3serve.kernels.ref.fused_moe import quant_rows_fp8_ref
    q, s = quant_rows_fp8_ref(x)
    a = q.to(dtype) * s.to(dtype)[:, None]
    return a @ dequantize("mxfp8", codes, scales).to(dtype).t()


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (e4m3 codes [..., N, K], E8M0 uint8 [..., N, K/32]); the exponent is
    ceil(log2(amax / 448)) + 127, clamped to [0, 254], so no element saturates."""
    x = _blocks(w.float(), MX_BLOCK)
    amax = x.abs().amax(-1)
    e = (torch.ceil(torch.log2(amax / E4M3_MAX)) + E8M0_BIAS).clamp(0, 254)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).to(torch.int32)
    inv = torch.ldexp(torch.ones_like(amax), E8M0_BIAS - e)
    q = (x * inv[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), e.to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (packed uint8 [..., N, K/2], E8M0 uint8 [..., N, K/32]) by the OCP MX
    rule: the block's amax rounded to the nearest 1.x5-step mantissa, its exponent minus 2
    (E2M1's largest exponent) is the shared exponent; elements round to nearest even and
    saturate at 6. Every element's error is at most one scale unit 2^(e - 127)."""
    x = _blocks(w.float(), MX_BLOCK)
    amax = x.abs().amax(-1)
    bits = amax.contiguous().view(torch.int32)
    rounded = ((bits + 0x200000) & 0x7F800000).view(torch.float32)
    exp = torch.frexp(rounded).exponent - 1                           # log2 of the power of two
    exp = torch.where(rounded > 0, exp, torch.full_like(exp, -127))
    e = (exp - 2 + E8M0_BIAS).clamp(0, 254)
    inv = torch.ldexp(torch.ones_like(amax), E8M0_BIAS - e)
    codes = float_to_e2m1(x * inv[..., None]).flatten(-2)
    return pack_fp4(codes), e.to(torch.uint8)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' global scale 448 * 6 / amax (fp32; amax 0 -> 1); dequantisation
    divides by it. ModelOpt stores the reciprocal, weight_scale_2 = amax / (448 * 6)."""
    amax = amax.float()
    return torch.where(amax > 0, (E4M3_MAX * E2M1_MAX) / amax, torch.ones_like(amax))


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] with a divisor-style global scale broadcastable to [..., N] -> (packed uint8
    [..., N, K/2], e4m3 block scales [..., N, K/16]): block scale = e4m3(block amax / 6 x
    global), element = e2m1(x x global / block scale)."""
    x = _blocks(w.float(), NVFP4_BLOCK)
    g = global_scale.float().expand(w.shape[:-1])[..., None]              # [..., N, 1]
    s = (x.abs().amax(-1) / E2M1_MAX * g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf = s.float()
    scaled = torch.where(sf[..., None] > 0, x * g[..., None] / sf[..., None], torch.zeros_like(x))
    return pack_fp4(float_to_e2m1(scaled).flatten(-2)), s
