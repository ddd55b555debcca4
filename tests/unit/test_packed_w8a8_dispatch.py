"""The W8A8 opt-in of MXFP8 linears (`layers/packed.packed_linear`, M3SERVE_MXFP8_W8A8): off by
default; on, only MXFP8 products of at least W8A8_MIN_ROWS rows quantise their activations per
token (the CPU path computes `w8a8_reference` in fp64), and dispatch records it."""
import pytest
import torch
from torch import nn

from m3serve import envs
from m3serve.kernels.ref import packed as rp
from m3serve.layers import dispatch
from m3serve.layers.packed import (
    MXFP4,
    MXFP8,
    W8A8_MIN_ROWS,
    packed_linear,
    set_packed_,
    w8a8_note,
)


def _module(fmt, n=48, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    m = nn.Module()
    if fmt is MXFP8:
        set_packed_(m, "weight", fmt, *rp.quantize_mxfp8(w))
    else:
        set_packed_(m, "weight", fmt, *rp.quantize_mxfp4(w))
    return m


def _w8a16(x, m, kind):
    deq = rp.dequantize(kind, m.weight, m.weight_block_scale).to(x.dtype)
    return (x.double() @ deq.double().t()).to(x.dtype)


@pytest.fixture
def rows():
    return torch.randn(W8A8_MIN_ROWS + 44, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def test_off_by_default(monkeypatch, rows):
    monkeypatch.delenv("M3SERVE_MXFP8_W8A8", raising=False)
    assert envs.env_flag("M3SERVE_MXFP8_W8A8") is False
    monkeypatch.setattr(envs, "MXFP8_W8A8", False)
    m = _module(MXFP8)
    assert torch.equal(packed_linear(rows, m), _w8a16(rows, m, "mxfp8"))


def test_on_quantises_mxfp8_prefill_activations(monkeypatch, rows):
    monkeypatch.setattr(envs, "MXFP8_W8A8", True)
    m = _module(MXFP8)
    before = dispatch.executed[("packed_linear_w8a8", "reference")]
    out = packed_linear(rows, m)
    want = rp.w8a8_reference(rows, m.weight, m.weight_block_scale, torch.float64).to(torch.bfloat16)
    assert torch.equal(out, want)
    assert not torch.equal(out, _w8a16(rows, m, "mxfp8"))
    assert dispatch.executed[("packed_linear_w8a8", "reference")] == before + 1
    # per token: a row's result does not depend on the other rows in the product
    assert torch.equal(packed_linear(rows[:W8A8_MIN_ROWS], m), out[:W8A8_MIN_ROWS])


def test_on_leaves_decode_rows_and_other_formats_alone(monkeypatch, rows):
    monkeypatch.setattr(envs, "MXFP8_W8A8", True)
    m8, m4 = _module(MXFP8), _module(MXFP4)
    few = rows[:W8A8_MIN_ROWS - 1]
    assert torch.equal(packed_linear(few, m8), _w8a16(few, m8, "mxfp8"))
    assert torch.equal(packed_linear(rows, m4), _w8a16(rows, m4, "mxfp4"))


@pytest.mark.parametrize("value,want", [("1", True), ("0", False), ("", False)])
def test_env_flag_values(monkeypatch, value, want):
    monkeypatch.setenv("M3SERVE_MXFP8_W8A8", value)
    assert envs.env_flag("M3SERVE_MXFP8_W8A8") is want


def test_env_flag_rejects_other_values(monkeypatch):
    monkeypatch.setenv("M3SERVE_MXFP8_W8A8", "yes")
    with pytest.raises(ValueError, match="M3SERVE_MXFP8_W8A8 must be 0 or 1, got 'yes'"):
        envs.env_flag("M3SERVE_MXFP8_W8A8")


def test_start_up_note(monkeypatch):
    model = nn.ModuleList([_module(MXFP8), _module(MXFP4), _module(MXFP8)])
    monkeypatch.setattr(envs, "MXFP8_W8A8", False)
    assert w8a8_note(model) is None
    monkeypatch.setattr(envs, "MXFP8_W8A8", True)
    assert w8a8_note(model).startswith("M3SERVE_MXFP8_W8A8=1: 2 MXFP8 weights")
    assert "no effect" in w8a8_note(nn.ModuleList([_module(MXFP4)]))
