"""The block-scaled weight codecs (`kernels/ref/packed.py`) against values worked out by hand
from the format definitions: E2M1 table and rounding, nibble order, E8M0 bias 127, e4m3 block
scales, the NVFP4 global scale that divides (compressed-tensors) or multiplies (ModelOpt), and
each quantiser's round trip within its format's bound."""
import math

import pytest
import torch

from m3serve.kernels.ref.packed import (dequantize, e2m1_to_float, e8m0_to_float, float_to_e2m1,
                                        nvfp4_global_scale, pack_fp4, quantize_mxfp4, quantize_mxfp8,
                                        quantize_nvfp4, unpack_fp4)

U8 = torch.uint8


def test_e2m1_table():
    codes = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 15], dtype=U8)
    want = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -3, -6]
    assert e2m1_to_float(codes).tolist() == want


def test_e2m1_rounding_is_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 5.0, 5.01, 100.0, -0.1, -3.0, -7.0])
    # ties: 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    want = [0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 0, 0b1101, 0b1111]
    assert float_to_e2m1(x).tolist() == want


def test_nibble_order_low_first():
    codes = torch.tensor([[1, 2, 7, 15]], dtype=U8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0xF7]]
    assert unpack_fp4(torch.tensor([[0x21, 0xF7]], dtype=U8)).tolist() == [[1, 2, 7, 15]]


def test_e8m0_bias_127():
    v = e8m0_to_float(torch.tensor([127, 128, 120, 0, 254, 255], dtype=U8))
    assert v[:5].tolist() == [1.0, 2.0, 2.0 ** -7, 2.0 ** -127, 2.0 ** 127]
    assert math.isnan(v[5])
    assert e8m0_to_float(torch.tensor([130], dtype=U8).view(torch.float8_e8m0fnu)).tolist() == [8.0]


def test_mxfp8_dequantise_by_hand():
    codes = torch.full((1, 64), 1.5).to(torch.float8_e4m3fn)
    scales = torch.tensor([[129, 126]], dtype=U8)                     # x4 for K 0..31, x0.5 after
    w = dequantize("mxfp8", codes, scales)
    assert w[0, :32].eq(6.0).all() and w[0, 32:].eq(0.75).all()


def test_mxfp4_dequantise_by_hand():
    packed = torch.full((1, 16), 0x71, dtype=U8)                    # elements 0.5 (low), 6 (high)
    w = dequantize("mxfp4", packed, torch.tensor([[128]], dtype=U8))
    assert w[0, 0::2].eq(1.0).all() and w[0, 1::2].eq(12.0).all()


def test_nvfp4_global_scale_divides_or_multiplies():
    packed = torch.full((2, 8), 0x77, dtype=U8)                     # every element 6.0
    block = torch.tensor([[0.5], [0.75]]).to(torch.float8_e4m3fn)   # one 16-block per row
    g = torch.tensor([2.0, 4.0])
    ct = dequantize("nvfp4", packed, block, g, global_divides=True)
    mo = dequantize("nvfp4", packed, block, g, global_divides=False)
    assert ct[0].eq(6 * 0.5 / 2).all() and ct[1].eq(6 * 0.75 / 4).all()
    assert mo[0].eq(6 * 0.5 * 2).all() and mo[1].eq(6 * 0.75 * 4).all()


def test_mxfp8_quantiser_exponent_rule():
    w = torch.zeros(1, 96)
    w[0, 0] = 448.0          # block 0: amax 448 -> exponent 0 (byte 127)
    w[0, 32] = 449.0         # block 1: just over -> byte 128; 449 / 2 = 224.5 -> e4m3 224
    w[0, 64:96] = 0.0        # block 2: all zero -> byte 0, codes 0
    q, s = quantize_mxfp8(w)
    assert s.tolist() == [[127, 128, 0]]
    assert q.float()[0, 0] == 448 and q.float()[0, 32] == 224
    assert dequantize("mxfp8", q, s)[0, 32] == 448


def test_mxfp4_quantiser_exponent_rule():
    w = torch.zeros(3, 32)
    w[0, 0], w[0, 1] = 6.0, -1.0       # amax 6 = 1.5 x 4: shared exponent 2 - 2 = 0 -> byte 127
    w[1, 0] = 7.0                      # 1.75 x 4 rounds up to 8: exponent 1 -> byte 128, 7/2 -> 4
    w[2, 0] = 6.9                      # 1.725 x 4 stays: byte 127, 6.9 saturates at 6
    q, s = quantize_mxfp4(w)
    assert s.flatten().tolist() == [127, 128, 127]
    d = dequantize("mxfp4", q, s)
    assert d[0, :2].tolist() == [6.0, -1.0] and d[1, 0] == 8.0 and d[2, 0] == 6.0


def test_nvfp4_quantiser_by_hand():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 16] = 2688.0, 3.0
    g = nvfp4_global_scale(w.abs().amax())                          # 448 * 6 / 2688 = 1
    assert g.item() == 1.0
    q, s = quantize_nvfp4(w, g)
    assert s.float().tolist() == [[448.0, 0.5]]                    # e4m3(amax / 6 * g)
    assert dequantize("nvfp4", q, s, g.expand(1))[0, [0, 16]].tolist() == [2688.0, 3.0]


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_round_trip_within_bound(fmt):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 16)[:, None]
    if fmt == "mxfp8":
        q, s = quantize_mxfp8(w)
        d = dequantize(fmt, q, s)
        # e4m3: 3 mantissa bits -> half a step is 2^-4 of the value, plus the subnormal spacing
        unit = e8m0_to_float(s).repeat_interleave(32, -1)
        assert ((d - w).abs() <= w.abs() * 2 ** -4 + unit * 2 ** -10).all()
    elif fmt == "mxfp4":
        q, s = quantize_mxfp4(w)
        d = dequantize(fmt, q, s)
        unit = e8m0_to_float(s).repeat_interleave(32, -1)
        assert ((d - w).abs() <= unit).all()                    # one scale unit at most
    else:
        g = nvfp4_global_scale(w.abs().amax(-1))
        q, s = quantize_nvfp4(w, g)
        d = dequantize(fmt, q, s, g)
        unit = (s.float() / g[:, None]).repeat_interleave(16, -1)
        # half the widest E2M1 gap (1 unit) plus the e4m3 rounding of the block scale (1/16)
        assert ((d - w).abs() <= unit * (1 + 6 / 16)).all()
