"""Triton fused per-head Gemma RMSNorm + partial NeoX RoPE + paged-cache write for one attention
layer: q/k (and the MSA indexer's iq/ik on sparse layers) in one launch. Rounding order matches
the layer code: norm in fp32 cast to the activation dtype, then each RoPE product and sum rounded
to the activation dtype, as bf16 tensor math does.

Grid: (tokens, q-head chunks + 1 [k, v, K/V cache write] + 1 [iq, ik, index-cache write]); each
job kind is its own device function that loads and stores its own tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3serve.kernels.pdl import enabled as pdl_enabled
from m3serve.kernels.pdl import launch_options, pdl_start
from m3serve.kernels.rmsnorm import cast_rne, interpreting

Q_HEADS_PER_PROG = 16


@triton.jit
def _norm_rope_tile(x_ptr, x_row, head_stride, n_heads, head0, w_ptr, cos_ptr, sin_ptr, cs_row,
                    eps, D: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr,
                    BLOCK_D: tl.constexpr, EMULATE: tl.constexpr):
    """Normalise + rotate heads head0 .. head0+HEADS-1 of one token. Returns (tile in the
    activation dtype [HEADS, BLOCK_D], heads [HEADS], cols [BLOCK_D], mask)."""
    heads = head0 + tl.arange(0, HEADS)
    cols = tl.arange(0, BLOCK_D)
    mask = (heads < n_heads)[:, None] & (cols < D)[None, :]
    base = x_ptr + x_row + heads[:, None].to(tl.int64) * head_stride
    x = tl.load(base + cols[None, :], mask=mask, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)                 # [HEADS]
    w1 = 1.0 + tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = cast_rne(xf * rstd[:, None] * w1[None, :], dt, EMULATE)
    # NeoX partner channel: c <-> c ± HALF inside the rotary part; re-read (L1 hit) and re-normalise
    pcols = tl.where(cols < HALF, cols + HALF, tl.where(cols < 2 * HALF, cols - HALF, cols))
    xp = tl.load(base + pcols[None, :], mask=mask, other=0.0).to(tl.float32)
    wp = 1.0 + tl.load(w_ptr + pcols, mask=cols < D, other=0.0).to(tl.float32)
    yp = cast_rne(xp * rstd[:, None] * wp[None, :], dt, EMULATE)
    rot = cols < 2 * HALF
    hc = tl.where(cols < HALF, cols, cols - HALF)
    c = tl.load(cos_ptr + cs_row + hc, mask=rot, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + cs_row + hc, mask=rot, other=0.0).to(tl.float32)[None, :]
    yc = cast_rne(y.to(tl.float32) * c, dt, EMULATE).to(tl.float32)
    ys = cast_rne(yp.to(tl.float32) * s, dt, EMULATE).to(tl.float32)
    lo = cast_rne(yc - ys, dt, EMULATE)
    hi = cast_rne(yc + ys, dt, EMULATE)
    out = tl.where((cols < HALF)[None, :], lo, tl.where(rot[None, :], hi, y))
    return out, heads, cols, mask


@triton.jit
def _store_cache(cache_ptr, slot, slot_stride, heads, cols, head_stride, vals, mask, scale_ptr,
                 scale_val, SCALE: tl.constexpr, EMULATE: tl.constexpr):
    """Write [HEADS, BLOCK_D] values at `slot` (skipped when slot < 0), IEEE-dividing by the
    scale: SCALE 0 = none, 1 = fp32 scalar at scale_ptr, 2 = the fp32 argument scale_val."""
    v = vals.to(tl.float32)
    if SCALE == 1:
        v = tl.math.div_rn(v, tl.load(scale_ptr))
    if SCALE == 2:
        v = tl.math.div_rn(v, scale_val)
    ptrs = cache_ptr + slot * slot_stride + heads[:, None] * head_stride + cols[None, :]
    keep = (tl.zeros([1, 1], dtype=tl.int64) + slot) >= 0  # a tensor mask: the interpreter
    tl.store(ptrs, cast_rne(v, cache_ptr.dtype.element_ty, EMULATE), mask=mask & keep)


# The three job kinds below each load and store their own tiles and return nothing: their tiles
# have different shapes, and compiled Triton forbids values of different shapes flowing out of
# the two sides of a run-time `if`.
@triton.jit
def _q_job(q_ptr, qw_ptr, qo_ptr, cos_ptr, sin_ptr, t, cs_row, q_s0, q_s1, Hq, head0, eps,
           D: tl.constexpr, HALF: tl.constexpr, QH: tl.constexpr, BLOCK_D: tl.constexpr,
           EMULATE: tl.constexpr):
    y, heads, cols, mask = _norm_rope_tile(q_ptr, t * q_s0, q_s1, Hq, head0, qw_ptr, cos_ptr,
                                           sin_ptr, cs_row, eps, D, HALF, QH, BLOCK_D, EMULATE)
    tl.store(qo_ptr + t * Hq * D + heads[:, None] * D + cols[None, :], y, mask=mask)


@triton.jit
def _kv_job(k_ptr, v_ptr, kw_ptr, kv_ptr, slot_ptr, cos_ptr, sin_ptr, ks_ptr, vs_ptr, ks_val,
            vs_val, t, cs_row, k_s0, k_s1, v_s0, v_s1, plane_stride, G, eps,
            D: tl.constexpr, HALF: tl.constexpr, KH: tl.constexpr, BLOCK_D: tl.constexpr,
            K_SCALE: tl.constexpr, V_SCALE: tl.constexpr, EMULATE: tl.constexpr):
    slot = tl.load(slot_ptr + t).to(tl.int64)
    y, heads, cols, mask = _norm_rope_tile(k_ptr, t * k_s0, k_s1, G, 0, kw_ptr, cos_ptr,
                                           sin_ptr, cs_row, eps, D, HALF, KH, BLOCK_D, EMULATE)
    _store_cache(kv_ptr, slot, G * D, heads, cols, D, y, mask, ks_ptr, ks_val, K_SCALE, EMULATE)
    vv = tl.load(v_ptr + t * v_s0 + heads[:, None] * v_s1 + cols[None, :], mask=mask, other=0.0)
    _store_cache(kv_ptr + plane_stride, slot, G * D, heads, cols, D, vv, mask, vs_ptr, vs_val,
                 V_SCALE, EMULATE)


@triton.jit
def _index_job(iq_ptr, ik_ptr, iqw_ptr, ikw_ptr, iqo_ptr, idx_ptr, slot_ptr, cos_ptr, sin_ptr,
               t, cs_row, iq_s0, iq_s1, ik_s0, Hi, eps, DI: tl.constexpr, HALF: tl.constexpr,
               IH: tl.constexpr, BLOCK_DI: tl.constexpr, EMULATE: tl.constexpr):
    slot = tl.load(slot_ptr + t).to(tl.int64)
    y, heads, cols, mask = _norm_rope_tile(iq_ptr, t * iq_s0, iq_s1, Hi, 0, iqw_ptr, cos_ptr,
                                           sin_ptr, cs_row, eps, DI, HALF, IH, BLOCK_DI, EMULATE)
    tl.store(iqo_ptr + t * Hi * DI + heads[:, None] * DI + cols[None, :], y, mask=mask)
    # the single index-key head as a 2-row tile (row 1 masked off): no 1-wide aranges
    yk, kheads, kcols, kmask = _norm_rope_tile(ik_ptr, t * ik_s0, 0, 1, 0, ikw_ptr, cos_ptr,
                                               sin_ptr, cs_row, eps, DI, HALF, 2, BLOCK_DI,
                                               EMULATE)
    _store_cache(idx_ptr, slot, DI, kheads, kcols, DI, yk, kmask, slot_ptr, 1.0, 0, EMULATE)


@triton.jit
def _qk_norm_rope_kernel(
        q_ptr, k_ptr, v_ptr, iq_ptr, ik_ptr, qw_ptr, kw_ptr, iqw_ptr, ikw_ptr, cos_ptr, sin_ptr,
        kv_ptr, idx_ptr, slot_ptr, qo_ptr, iqo_ptr, ks_ptr, vs_ptr, ks_val, vs_val,
        q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, iq_s0, iq_s1, ik_s0, cs_s0, plane_stride,
        Hq, G, Hi, eps,
        D: tl.constexpr, DI: tl.constexpr, HALF: tl.constexpr, QH: tl.constexpr,
        KH: tl.constexpr, IH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
        HAS_INDEX: tl.constexpr, K_SCALE: tl.constexpr, V_SCALE: tl.constexpr,
        EMULATE: tl.constexpr,
        PDL: tl.constexpr):
    pdl_start(PDL)
    # job < n_q: a chunk of QH q heads; job == n_q: K + V into the kv cache; job == n_q + 1:
    # iq + ik into the index cache (sparse layers only)
    t = tl.program_id(0).to(tl.int64)
    job = tl.program_id(1)
    n_q = tl.cdiv(Hq, QH)
    cs_row = t * cs_s0
    if job < n_q:
        _q_job(q_ptr, qw_ptr, qo_ptr, cos_ptr, sin_ptr, t, cs_row, q_s0, q_s1, Hq, job * QH, eps,
               D, HALF, QH, BLOCK_D, EMULATE)
    elif job == n_q:
        _kv_job(k_ptr, v_ptr, kw_ptr, kv_ptr, slot_ptr, cos_ptr, sin_ptr, ks_ptr, vs_ptr, ks_val,
                vs_val, t, cs_row, k_s0, k_s1, v_s0, v_s1, plane_stride, G, eps, D, HALF, KH,
                BLOCK_D, K_SCALE, V_SCALE, EMULATE)
    elif HAS_INDEX:
        _index_job(iq_ptr, ik_ptr, iqw_ptr, ikw_ptr, iqo_ptr, idx_ptr, slot_ptr, cos_ptr, sin_ptr,
                   t, cs_row, iq_s0, iq_s1, ik_s0, Hi, eps, DI, HALF, IH, BLOCK_DI, EMULATE)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _scale_args(scale, name: str, device: torch.device):
    """(pointer-or-None, fp32 value, SCALE mode) for an optional per-tensor scale; a host float
    travels as a kernel argument, so no host -> device copy happens per call."""
    if scale is None:
        return None, 1.0, 0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
            raise ValueError(f"{name} must be one fp32 value on {device}, got "
                             f"{tuple(scale.shape)} {scale.dtype} on {scale.device}")
        return scale, 1.0, 1
    return None, float(scale), 2


def qk_norm_rope_cache(q, k, v, iq, ik, q_norm_w, k_norm_w, iq_norm_w, ik_norm_w, cos, sin,
                       kv_cache, index_cache, slot_mapping, eps, *, k_scale=None, v_scale=None):
    """Fused QK norm + RoPE + cache write for one attention layer.

    q: [T, Hq, D]; k, v: [T, G, D]; iq: [T, Hi, Di] and ik: [T, 1, Di] or [T, Di] on sparse
    layers (None with iq_norm_w/ik_norm_w/index_cache on dense layers). Inputs may be strided
    views of the fused projection output but need a unit last stride. *_norm_w: [D] / [Di]
    Gemma weights (offset from 1). cos, sin: [T, R/2] in the activation dtype (R = rotary dim
    <= min(D, Di)). kv_cache: [2, num_blocks, block_size, G, D] contiguous (plane 0 gets
    norm+RoPE K, plane 1 raw V); index_cache: [num_blocks, block_size, Di] contiguous (gets
    norm+RoPE ik, plain cast). slot_mapping: [T] int, slot < 0 skipped. k_scale/v_scale:
    optional per-tensor scales for an fp8 kv_cache, a one-element fp32 device tensor or a host
    float: stored = dtype(fp32(v) / fp32(scale)), IEEE division.

    Returns (q_out [T, Hq, D], iq_out [T, Hi, Di] or None), contiguous, activation dtype.

    CUDA-graph safe: no host sync and no host -> device copy (a float scale is a kernel
    argument); the outputs are sized from T alone; one kernel launch (plus a cos/sin copy only
    when they are not row-contiguous).
    """
    _need(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, f"q/k/v must be 3-D, got "
          f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    T, Hq, D = q.shape
    G = k.shape[1]
    _need(k.shape == (T, G, D) and v.shape == (T, G, D),
          f"k {tuple(k.shape)} / v {tuple(v.shape)} must be [{T}, G, {D}]")
    half = cos.shape[-1]
    _need(cos.shape == (T, half) and sin.shape == (T, half) and 2 * half <= D,
          f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must be [{T}, <= {D // 2}]")
    _need(kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[3:] == (G, D)
          and kv_cache.is_contiguous(),
          f"kv_cache {tuple(kv_cache.shape)} must be contiguous [2, blocks, block_size, {G}, {D}]")
    _need(slot_mapping.shape == (T,), f"slot_mapping {tuple(slot_mapping.shape)} != ({T},)")
    has_index = iq is not None
    if has_index:
        Hi, Di = iq.shape[1], iq.shape[2]
        ik = ik.reshape(T, Di) if ik.dim() == 3 else ik
        _need(iq.shape[0] == T and ik.shape == (T, Di) and 2 * half <= Di,
              f"iq {tuple(iq.shape)} / ik {tuple(ik.shape)} do not match T={T}, rotary {2 * half}")
        _need(index_cache.dim() == 3 and index_cache.shape[2] == Di and index_cache.is_contiguous(),
              f"index_cache {tuple(index_cache.shape)} must be contiguous "
              f"[blocks, block_size, {Di}]")
        _need(iq.stride(-1) == 1 and ik.stride(-1) == 1, "iq/ik need a unit last stride")
    else:
        Hi, Di = 0, D
    _need(q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1,
          "q/k/v need a unit last stride")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    ks_ptr, ks_val, ks_mode = _scale_args(k_scale, "k_scale", q.device)
    vs_ptr, vs_val, vs_mode = _scale_args(v_scale, "v_scale", q.device)

    q_out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    iq_out = torch.empty((T, Hi, Di), dtype=iq.dtype, device=q.device) if has_index else None
    if T == 0:
        return q_out, iq_out
    QH = min(Q_HEADS_PER_PROG, triton.next_power_of_2(Hq))
    n_jobs = triton.cdiv(Hq, QH) + 1 + int(has_index)
    dummy = q_out
    pdl = pdl_enabled(q)
    _qk_norm_rope_kernel[(T, n_jobs)](
        q, k, v, iq if has_index else dummy, ik if has_index else dummy,
        q_norm_w, k_norm_w, iq_norm_w if has_index else q_norm_w,
        ik_norm_w if has_index else q_norm_w, cos, sin,
        kv_cache, index_cache if has_index else dummy, slot_mapping, q_out,
        iq_out if has_index else dummy,
        ks_ptr if ks_ptr is not None else dummy, vs_ptr if vs_ptr is not None else dummy,
        ks_val, vs_val,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        iq.stride(0) if has_index else 0, iq.stride(1) if has_index else 0,
        ik.stride(0) if has_index else 0, cos.stride(0), kv_cache.numel() // 2,
        Hq, G, Hi, eps,
        D=D, DI=Di, HALF=half, QH=QH, KH=triton.next_power_of_2(G),
        IH=triton.next_power_of_2(max(Hi, 1)), BLOCK_D=triton.next_power_of_2(D),
        BLOCK_DI=triton.next_power_of_2(Di), HAS_INDEX=has_index,
        K_SCALE=ks_mode, V_SCALE=vs_mode, EMULATE=interpreting(), PDL=pdl,
        num_warps=4, **launch_options(pdl))
    return q_out, iq_out
