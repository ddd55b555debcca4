"""One-kernel versions of small per-step computations that PyTorch spreads over several
launches (about 17 kernels of 1-6 µs each in a decode step, before the first layer):
  decode_positions_slots: each request's one query position (seq_len - 1) and its cache slot;
  rope_cos_sin: the rotary cos/sin rows of a step's positions (fp32 angle = position x inverse
      frequency, CUDA's cosf/sinf through libdevice as torch uses them, one rounding).
  embedding_rows: the embedding table's rows of a step's token ids (a plain copy; torch's
      indexing kernel took 6 µs for one int32 id in a decode graph, with an int64 cast before it).
All return exactly what their PyTorch twins return (tests/kernels/test_step_inputs*.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from m3serve.kernels.pdl import enabled as pdl_enabled
from m3serve.kernels.pdl import launch_options, pdl_start
from m3serve.kernels.rmsnorm import cast_rne, interpreting


@triton.jit(do_not_specialize=["num_reqs"])
def _positions_slots_kernel(seq_ptr, tables_ptr, pos_ptr, slot_ptr, num_reqs, stride_t,
                            block_size, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):
    pdl_start(PDL)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < num_reqs
    pos = tl.load(seq_ptr + r, mask=ok, other=1).to(tl.int64) - 1
    page = tl.load(tables_ptr + r.to(tl.int64) * stride_t + pos // block_size, mask=ok, other=0)
    tl.store(pos_ptr + r, pos, mask=ok)
    tl.store(slot_ptr + r, page.to(tl.int64) * block_size + pos % block_size, mask=ok)


def decode_positions_slots(seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_lens [R] int32, block_tables [R, W] int32 (any strides) -> (positions [R] int64, slots
    [R] int64)."""
    R = seq_lens.shape[0]
    seq_lens = seq_lens.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    pos = torch.empty(R, dtype=torch.int64, device=seq_lens.device)
    slots = torch.empty(R, dtype=torch.int64, device=seq_lens.device)
    if R:
        block = 256            # one variant whatever R (eager steps of any size compile nothing)
        pdl = pdl_enabled(seq_lens)
        _positions_slots_kernel[(triton.cdiv(R, block),)](seq_lens, block_tables, pos, slots, R,
                                                          block_tables.stride(0), block_size,
                                                          BLOCK=block, PDL=pdl, num_warps=4,
                                                          **launch_options(pdl))
    return pos, slots


@triton.jit
def _cos_sin_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, num_tokens, scale,
                    HALF: tl.constexpr, BLOCK_T: tl.constexpr, SCALED: tl.constexpr,
                    EMULATE: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_start(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, HALF)
    ok = t < num_tokens
    angle = tl.load(pos_ptr + t, mask=ok, other=0).to(tl.float32)[:, None] * tl.load(inv_ptr + j)[None, :]
    if EMULATE:                          # the interpreter has no libdevice; numpy's cos/sin
        c = tl.cos(angle)
        s = tl.sin(angle)
    else:
        c = libdevice.cos(angle)
        s = libdevice.sin(angle)
    if SCALED:
        c = c * scale
        s = s * scale
    offs = t.to(tl.int64)[:, None] * HALF + j[None, :]
    tl.store(cos_ptr + offs, cast_rne(c, cos_ptr.dtype.element_ty, EMULATE), mask=ok[:, None])
    tl.store(sin_ptr + offs, cast_rne(s, sin_ptr.dtype.element_ty, EMULATE), mask=ok[:, None])


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (int), inv_freq [half] fp32 (a power of two) -> cos, sin [T, half] in dtype,
    each times `scale` (YaRN's attention factor) before the rounding."""
    T, half = positions.shape[0], inv_freq.shape[0]
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    cos = torch.empty((T, half), dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if T:
        block_t = max(1, min(64, 4096 // half))
        pdl = pdl_enabled(positions)
        _cos_sin_kernel[(triton.cdiv(T, block_t),)](positions, inv_freq, cos, sin, T, scale, HALF=half,
                                                    BLOCK_T=block_t, SCALED=scale != 1.0,
                                                    EMULATE=interpreting(), PDL=pdl, num_warps=4,
                                                    **launch_options(pdl))
    return cos, sin


@triton.jit
def _embedding_rows_kernel(ids_ptr, table_ptr, out_ptr, hidden, stride_t, stride_o,
                           BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    row = tl.load(ids_ptr + t).to(tl.int64)
    tl.store(out_ptr + t * stride_o + cols, tl.load(table_ptr + row * stride_t + cols, mask=ok),
             mask=ok)


def embedding_rows(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ids [T] int32/int64 (each in [0, V)), table [V, H] with unit last stride -> [T, H], equal
    to table[ids]. One launch, no host sync (CUDA-graph safe); ids are not range-checked (the
    engine validates token ids when a request arrives)."""
    if ids.dim() != 1 or table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"embedding_rows needs ids [T] and a [V, H] table with unit last stride, "
                         f"got {tuple(ids.shape)} and {tuple(table.shape)}")
    T, H = ids.shape[0], table.shape[1]
    out = torch.empty((T, H), dtype=table.dtype, device=table.device)
    if T:
        block = min(1024, triton.next_power_of_2(H))
        pdl = pdl_enabled(table)
        _embedding_rows_kernel[(T, triton.cdiv(H, block))](
            ids.contiguous(), table, out, H, table.stride(0), out.stride(0), BLOCK=block,
            PDL=pdl, num_warps=4, **launch_options(pdl))
    return out
