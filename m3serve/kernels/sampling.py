"""Sort-free top-k and top-p thresholds: each row's cut-off logit tau (keep logit >= tau) found by
a radix search over the row's values instead of a [R, vocab] sort.

Every fp32 logit maps to an order-preserving 32-bit key. Three rounds each build a histogram of
the row's weight over the next 12, 10 and 10 bits of the key, among the values whose higher bits
match the prefix chosen so far, and a one-program scan per row picks the bin where the weight at
or above it first reaches the target. After the third round the prefix is the whole key of tau,
one of the row's own values. Weights are integers (1 per token for top-k, the fixed-point mass of
`ref/sampling.py` for top-p), so the integer atomics add up to the same totals in any order: the
result does not depend on scheduling. Definitions and their PyTorch twins: `ref/sampling.py`.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from m3serve.kernels.ref.sampling import MASS_SCALE

ROUNDS = ((20, 12), (10, 10), (0, 10))  # (shift, bits) of each round's digit in the key
CHUNK = 2048    # values per histogram program (decode_kernels_bench.py sample_rounds)
_SCALE = tl.constexpr(MASS_SCALE)


@triton.jit
def _key(x):
    """fp32 -> int64 in [0, 2^32), ordered as the floats (-inf lowest)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return bits.to(tl.int64) + 2147483648


@triton.jit
def _hist_kernel(x_ptr, stride_x, V, top_ptr, state_ptr, hist_ptr, stride_h,
                 SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr,
                 MASS: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=ok, other=float("-inf"))
    key = _key(x)
    if not FIRST:
        ok = ok & ((key >> (SHIFT + BITS)) == tl.load(state_ptr + row * 3))
    if MASS:
        top = tl.load(top_ptr + row)
        w = tl.floor(tl.exp(x - top) * _SCALE + 0.5).to(tl.int64)
        ok = ok & (x > float("-inf")) & (w > 0)
    else:
        w = tl.full([CHUNK], 1, tl.int64)
    digit = (key >> SHIFT) & ((1 << BITS) - 1)
    tl.atomic_add(hist_ptr + row * stride_h + digit, w, mask=ok, sem="relaxed")


@triton.jit
def _scan_kernel(hist_ptr, stride_h, state_ptr, param_ptr, tau_ptr, V,
                 BITS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                 MASS: tl.constexpr):
    row = tl.program_id(0)
    NB: tl.constexpr = 1 << BITS
    i = tl.arange(0, NB)
    h = tl.load(hist_ptr + row * stride_h + (NB - 1 - i))          # [NB] bins, highest first
    if FIRST:
        prefix = tl.zeros((), tl.int64)
        above = tl.zeros((), tl.int64)
        if MASS:
            total = tl.sum(h, 0)
            p = tl.load(param_ptr + row)
            target = tl.ceil(p.to(tl.float64) * total.to(tl.float64)).to(tl.int64)
            target = tl.minimum(tl.maximum(target, 1), total)
        else:
            target = tl.load(param_ptr + row).to(tl.int64)
        tl.store(state_ptr + row * 3 + 2, target)
    else:
        prefix = tl.load(state_ptr + row * 3)
        above = tl.load(state_ptr + row * 3 + 1)
        target = tl.load(state_ptr + row * 3 + 2)
    reach = above + tl.cumsum(h, 0) >= target
    first = tl.min(tl.where(reach, i, NB - 1), 0)             # the bin where the target is met
    above += tl.sum(tl.where(i < first, h, 0), 0)
    prefix = prefix * NB + (NB - 1 - first)
    if LAST:
        key = (prefix - 2147483648).to(tl.int32)
        tau = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        if MASS:
            keep_all = tl.load(param_ptr + row) >= 1.0
        else:
            keep_all = tl.load(param_ptr + row) >= V
        tl.store(tau_ptr + row, tl.where(keep_all, float("-inf"), tau))
    else:
        tl.store(state_ptr + row * 3, prefix)
        tl.store(state_ptr + row * 3 + 1, above)


def _threshold(logits: torch.Tensor, param: torch.Tensor, mass: bool) -> torch.Tensor:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"sampling thresholds need [R, V] fp32 logits with unit column stride, "
                         f"got {tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")
    R, V = logits.shape
    tau = torch.empty(R, dtype=torch.float32, device=logits.device)
    if R == 0:
        return tau
    offsets = [0, *itertools.accumulate(1 << bits for _, bits in ROUNDS)]  # rounds' bins
    hist = torch.zeros(R, offsets[-1], dtype=torch.int64, device=logits.device)
    state = torch.empty(R, 3, dtype=torch.int64, device=logits.device)  # prefix, above, target
    top = logits.amax(dim=-1) if mass else tau     # top-k reads no row maximum
    param = param.contiguous()
    for r, (shift, bits) in enumerate(ROUNDS):
        bins = hist[:, offsets[r]:]
        _hist_kernel[(R, triton.cdiv(V, CHUNK))](
            logits, logits.stride(0), V, top, state, bins, hist.stride(0), SHIFT=shift,
            BITS=bits, FIRST=r == 0, MASS=mass, CHUNK=CHUNK, num_warps=4)
        _scan_kernel[(R,)](bins, hist.stride(0), state, param, tau, V, BITS=bits, FIRST=r == 0,
                           LAST=r == len(ROUNDS) - 1, MASS=mass,
                           num_warps=max(4, min(16, (1 << bits) // 256)))
    return tau


def top_k_threshold(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """logits [R, V] fp32, k [R] int64 in [1, V] -> tau [R] fp32: the k-th largest logit, or
    -inf where k >= V (same as `top_k_threshold_ref`)."""
    return _threshold(logits, k, mass=False)


def top_p_threshold(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] fp32 (finite or -inf, at least one finite value per row), p [R] fp32 in
    (0, 1] -> tau [R] fp32, the nucleus cut-off of `top_p_threshold_ref` (-inf where p >= 1)."""
    return _threshold(logits, p, mass=True)
