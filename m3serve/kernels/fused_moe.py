"""Fused MoE for MiniMax-M3 in Triton: sigmoid top-k routing, token alignment by expert, and two
grouped GEMMs (gate_up with SwiGLU-OAI in the epilogue; down with the routing weight and the sum
over the chosen experts in the epilogue). bf16 weights, or FP8 e4m3 weights with per-output-channel
scales and per-token dynamic activation scales (docs/model.md §8.3). The shared expert runs as one more,
always-selected expert with weight 1.0.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from m3serve import envs
from m3serve.kernels.packed_gemm import (PACK_CODES, SCALE_BLOCK, even_odd_columns, fp4_tiles,
                                         mxfp8_tile)
from m3serve.kernels.ref.fused_moe import FP8_MIN_SCALE, max_aligned_blocks, moe_route_ref
from m3serve.kernels.pdl import enabled as pdl_enabled
from m3serve.kernels.pdl import launch_options, pdl_start
from m3serve.kernels.rmsnorm import cast_rne
from m3serve.kernels.tma import tma_ready


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# Tokens up to this count route in the fused kernels; more go through torch, which was faster
# from about 40 tokens on with the first tiles (H200, 128 x 6144: 8.5 vs 25.6 us at 1 token,
# 17.0 vs 35.7 at 8, 48.0 vs 38.6 at 64; 6.9 us at 1 token with today's; docs/performance.md)
ROUTE_FUSED_MAX_TOKENS = 32
ROUTE_BLOCK_K = 128     # hidden columns per K step of the router's partial-logit kernel
ROUTE_ITERS = 2         # K steps per program (scripts/decode_kernels_bench.py route)
ROUTE_MAX_SPLITS = 48   # partials the top-k kernel sums
# From ROUTE_TC_MIN_TOKENS bf16 tokens on (M3SERVE_ROUTE_TENSOR_CORES, on by default): the logits
# on tensor cores in tiles of ROUTE_TC_BLOCK_T tokens x ROUTE_TC_BLOCK_E experts, the hidden
# dimension split over ROUTE_TC_SPLITS programs (their partial logits summed by the top-k kernel).
# Measured on an H100 (128 x 6144, µs, scripts/decode_kernels_bench.py route_prefill, three runs):
# torch's fp32 route 123-344 / 289-349 / 951-959 at 1024 / 4096 / 16384 tokens; these tiles (128
# tokens, K steps of 32, 4 splits) 65-69 / 76-110 / 219-220; one split (K steps of 64): ~217 /
# 225 / 247 (a program's walk over K is the floor). Below 1024 tokens torch's times were too
# noisy to call.
ROUTE_TC_MIN_TOKENS = 1024
ROUTE_TC_SPLITS = 4
ROUTE_TC_BLOCK_T = 128
ROUTE_TC_BLOCK_E = 128
ROUTE_TC_BLOCK_K = 32


@triton.jit
def _route_partial(x_ptr, w_ptr, part_ptr, num_tokens, hidden, stride_x, k_per_split, pid_t,
                   pid_e, pid_s, num_e, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """x[t-block] . w[e-block]^T over the pid_s-th slice of the hidden dimension, into
    part[pid_s] (CUDA-core fp32 products, exact like the reference)."""
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < num_tokens
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    start = pid_s * k_per_split
    for k0 in range(start, start + k_per_split, BLOCK_K):
        cols = k0 + offs_k
        k_ok = cols < hidden
        xt = tl.load(x_ptr + offs_t.to(tl.int64)[:, None] * stride_x + cols[None, :],
                     mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + offs_e[:, None] * hidden + cols[None, :], mask=k_ok[None, :], other=0.0)
        acc += tl.sum(xt[:, None, :] * wt[None, :, :], axis=2)              # [BLOCK_T, BLOCK_E]
    out = part_ptr + (pid_s * num_tokens + offs_t.to(tl.int64))[:, None] * num_e + offs_e[None, :]
    tl.store(out, acc, mask=t_ok[:, None])


@triton.jit(do_not_specialize=["num_tokens"])
def _route_scores_kernel(x_ptr, w_ptr, part_ptr, num_tokens, hidden, stride_x, k_per_split,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):
    """Partial router logits: program (t, e, s) runs `_route_partial`. Many programs share the
    weight read, which one program could not do fast."""
    pdl_start(PDL)
    _route_partial(x_ptr, w_ptr, part_ptr, num_tokens, hidden, stride_x, k_per_split,
                   tl.program_id(0), tl.program_id(1), tl.program_id(2),
                   tl.num_programs(1) * BLOCK_E, BLOCK_T, BLOCK_E, BLOCK_K)


@triton.jit
def _route_topk_rows(part_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, t0, scale,
                     E: tl.constexpr, SPLITS: tl.constexpr, TOP_K: tl.constexpr,
                     BLOCK_T: tl.constexpr, BYPASS_L1: tl.constexpr):
    """Tokens t0 .. t0 + BLOCK_T - 1 (those below num_tokens) at once: logits = the partials
    summed in split order, sigmoid, top-k of score + bias (lowest id among equal values), the
    chosen scores renormalised (summed in choice order) and scaled. Each token's values are the
    same bits whatever BLOCK_T. BYPASS_L1: the partials were written by other programs of the
    same launch (read from L2)."""
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_ok = offs_t < num_tokens
    offs_e = tl.arange(0, E)
    rows = offs_t.to(tl.int64)[:, None] * E + offs_e[None, :]                  # [BLOCK_T, E]
    logits = tl.zeros((BLOCK_T, E), dtype=tl.float32)
    for sp in tl.static_range(SPLITS):
        at_split = part_ptr + sp * num_tokens * E + rows
        if BYPASS_L1:
            logits += tl.load(at_split, mask=t_ok[:, None], other=0.0, cache_modifier=".cg")
        else:
            logits += tl.load(at_split, mask=t_ok[:, None], other=0.0)
    scores = tl.sigmoid(logits)
    choice = scores + tl.load(bias_ptr + offs_e)[None, :]
    offs_k = tl.arange(0, TOP_K)
    picked_w = tl.zeros((BLOCK_T, TOP_K), dtype=tl.float32)
    picked_id = tl.zeros((BLOCK_T, TOP_K), dtype=tl.int32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)                                           # [BLOCK_T]
        at = tl.min(tl.where(choice == best[:, None], offs_e[None, :], E), axis=1)
        hit = offs_e[None, :] == at[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)                          # one term: exact
        total += w
        picked_w = tl.where(offs_k[None, :] == k, w[:, None], picked_w)
        picked_id = tl.where(offs_k[None, :] == k, at[:, None], picked_id)
        choice = tl.where(hit, float("-inf"), choice)
    picked_w = picked_w / total[:, None] * scale
    out = offs_t.to(tl.int64)[:, None] * TOP_K + offs_k[None, :]
    tl.store(weights_ptr + out, picked_w, mask=t_ok[:, None])
    tl.store(ids_ptr + out, picked_id, mask=t_ok[:, None])


@triton.jit(do_not_specialize=["num_tokens"])
def _route_logits_tc_kernel(x_ptr, w_ptr, out_ptr, num_tokens, hidden, stride_x, k_per_split,
                            E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                            BLOCK_K: tl.constexpr, F32_DOTS: tl.constexpr):
    """Router logits on tensor cores: x [T, H] bf16 against the fp32 gate w [E, H] -> out
    [splits, T, E] fp32, program (t, e, s) summing hidden columns [s k_per_split, (s + 1)
    k_per_split) into out[s] (`_route_topk_kernel` adds the splits in order). Each fp32 weight
    is split in registers into three bf16 parts, hi + mid + lo, whose sum is exactly the weight
    (8 significant bits each: fp32's 24), so every product of a bf16 activation and a part is
    exact in fp32, and the products are summed in fp32: the fp32 reference's products, summed
    in another order. F32_DOTS (the interpreter, whose bf16 dots are wrong): the same bf16
    values multiplied as fp32."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < num_tokens
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, hidden), BLOCK_K):
        cols = k0 + offs_k
        k_ok = cols < hidden
        a = tl.load(x_ptr + offs_t.to(tl.int64)[:, None] * stride_x + cols[None, :],
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0)              # [BLOCK_T, BLOCK_K]
        w = tl.load(w_ptr + offs_e[None, :] * hidden + cols[:, None], mask=k_ok[:, None],
                    other=0.0)                                                  # [BLOCK_K, BLOCK_E]
        hi = w.to(tl.bfloat16)
        rest = w - hi.to(tl.float32)                      # exact: below hi's last bit
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)  # exact: at most 8 bits remain
        if F32_DOTS:
            a32 = a.to(tl.float32)
            acc = tl.dot(a32, hi.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(a32, mid.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(a32, lo.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, hi, acc)
            acc = tl.dot(a, mid, acc)
            acc = tl.dot(a, lo, acc)
    rows = split.to(tl.int64) * num_tokens + offs_t.to(tl.int64)
    tl.store(out_ptr + rows[:, None] * E + offs_e[None, :], acc, mask=t_ok[:, None])


@triton.jit(do_not_specialize=["num_tokens"])
def _route_topk_kernel(part_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, scale,
                       E: tl.constexpr, SPLITS: tl.constexpr, TOP_K: tl.constexpr,
                       PDL: tl.constexpr):
    """One token per program (`_route_topk_rows`)."""
    pdl_start(PDL)
    _route_topk_rows(part_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, tl.program_id(0).to(tl.int64),
                     scale, E, SPLITS, TOP_K, 1, False)


def route_tiles(num_tokens: int, num_experts: int, hidden: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K, splits) of the router's partial-logit kernel. BLOCK_K and the
    split count depend on the hidden size only, so every token's logits are summed in the same
    order whatever the batch (a request routes the same beside 0 or 31 others); enough splits
    that each program runs ROUTE_ITERS K steps (the 3 MB fp32 gate streams from many SMs); the
    expert tile narrows as the token tile widens (2048-4096 products per program)."""
    block_k = min(ROUTE_BLOCK_K, max(16, triton.next_power_of_2(hidden)))
    splits = max(1, min(ROUTE_MAX_SPLITS, triton.cdiv(hidden, block_k * ROUTE_ITERS)))
    block_t = min(16, triton.next_power_of_2(num_tokens))
    block_e = min(num_experts, 16, max(2, 2048 // (block_t * block_k)))
    return block_t, block_e, block_k, splits


def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int,
              routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only correction bias (docs/model.md §3.7).

    x: [T, H]; gate_weight: [E, H] fp32; bias: [E] fp32.
    Returns (weights [T, K] fp32, renormalised over the chosen experts and multiplied by
    routed_scaling_factor; ids [T, K] int32). On a GPU, up to ROUTE_FUSED_MAX_TOKENS tokens: two
    kernels (split-hidden partial logits on CUDA cores, then sum + sigmoid + top-k); from
    ROUTE_TC_MIN_TOKENS bf16 tokens on: the logits on tensor cores (`_route_logits_tc_kernel`),
    then the same top-k kernel; otherwise the same math in torch (cuBLAS fp32). The three sum the products in different
    orders: scores agree to fp32 rounding.
    """
    num_experts = gate_weight.shape[0]
    if top_k < 1 or top_k > num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    num_tokens, hidden = x.shape
    pdl = pdl_enabled(x)
    fits = ((x.is_cuda or _INTERPRET) and num_tokens > 0 and x.stride(1) == 1
            and num_experts == triton.next_power_of_2(num_experts) and num_experts <= 256
            and top_k == triton.next_power_of_2(top_k))
    if (fits and num_tokens >= max(ROUTE_TC_MIN_TOKENS, ROUTE_FUSED_MAX_TOKENS + 1)
            and x.dtype == torch.bfloat16 and num_experts >= 16 and envs.ROUTE_TENSOR_CORES):
        w, b = gate_weight.float().contiguous(), bias.float().contiguous()
        block_e = min(num_experts, ROUTE_TC_BLOCK_E)
        # whole K steps per split; fewer splits where the hidden dimension has too few steps
        step = ROUTE_TC_BLOCK_K
        k_per_split = triton.cdiv(triton.cdiv(hidden, max(1, ROUTE_TC_SPLITS)), step) * step
        splits = triton.cdiv(hidden, k_per_split)
        logits = torch.empty(splits, num_tokens, num_experts, dtype=torch.float32, device=x.device)
        _route_logits_tc_kernel[(triton.cdiv(num_tokens, ROUTE_TC_BLOCK_T), num_experts // block_e, splits)](
            x, w, logits, num_tokens, hidden, x.stride(0), k_per_split, E=num_experts,
            BLOCK_T=ROUTE_TC_BLOCK_T, BLOCK_E=block_e, BLOCK_K=ROUTE_TC_BLOCK_K, F32_DOTS=_INTERPRET,
            num_warps=8)
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
        _route_topk_kernel[(num_tokens,)](logits, b, weights, ids, num_tokens, routed_scaling_factor,
                                          E=num_experts, SPLITS=splits, TOP_K=top_k, PDL=pdl, num_warps=4,
                                          **launch_options(pdl))
        return weights, ids
    if fits and num_tokens <= ROUTE_FUSED_MAX_TOKENS:
        w, b = gate_weight.float().contiguous(), bias.float().contiguous()
        block_t, block_e, block_k, splits = route_tiles(num_tokens, num_experts, hidden)
        k_per_split = triton.cdiv(triton.cdiv(hidden, splits), block_k) * block_k
        part = torch.empty(splits, num_tokens, num_experts, dtype=torch.float32, device=x.device)
        _route_scores_kernel[(triton.cdiv(num_tokens, block_t), num_experts // block_e, splits)](
            x, w, part, num_tokens, hidden, x.stride(0), k_per_split,
            BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, PDL=pdl, num_warps=4, **launch_options(pdl))
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
        _route_topk_kernel[(num_tokens,)](part, b, weights, ids, num_tokens, routed_scaling_factor,
                                          E=num_experts, SPLITS=splits, TOP_K=top_k, PDL=pdl, num_warps=4,
                                          **launch_options(pdl))
        return weights, ids
    return moe_route_ref(x, gate_weight, bias, top_k, routed_scaling_factor)


@triton.jit
def _slot_of(ids_ptr, idx, num_pairs, num_choices, top_k, first_expert, num_experts,
             HAS_SHARED: tl.constexpr, DROP: tl.constexpr):
    """Expert slot of flat pair idx = t * num_choices + k: ids[t, k] - first_expert when this
    rank owns it, num_experts for the shared choice k == top_k, DROP otherwise."""
    in_range = idx < num_pairs
    token = idx // num_choices
    choice = idx % num_choices
    routed = in_range & (choice < top_k)
    local = tl.load(ids_ptr + token * top_k + choice, mask=routed, other=0) - first_expert
    slot = tl.where(routed & (local >= 0) & (local < num_experts), local, DROP)
    if HAS_SHARED:
        slot = tl.where(in_range & (choice == top_k), num_experts, slot)
    return slot


@triton.jit
def _align_plan(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_post_ptr, cursor_ptr,
                num_pairs, num_choices, top_k, first_expert, num_experts, num_slots,
                num_blocks, block_m, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr,
                BINS: tl.constexpr, BLOCK_B: tl.constexpr, SCATTER: tl.constexpr,
                COUNTED: tl.constexpr):
    """One program: per-slot counts, padded run offsets (-> cursor), block -> expert map,
    padded length, and (unless COUNTED) sorted_ids filled with the padding value; with SCATTER
    it then places the pairs too (after a barrier: the cursor and the fill are visible to all
    its threads). COUNTED: `_align_count_kernel` left the counts in cursor [BINS] and the
    caller filled sorted_ids (a large step: many programs do both faster)."""
    bins = tl.arange(0, BINS)
    if COUNTED:
        counts = tl.load(cursor_ptr + bins)
        tl.debug_barrier()   # every warp has read the counts before any overwrites them below
    else:
        counts = tl.zeros((BINS,), dtype=tl.int32)
        for start in range(0, num_pairs, BLOCK):
            slot = _slot_of(ids_ptr, start + tl.arange(0, BLOCK), num_pairs, num_choices, top_k,
                            first_expert, num_experts, HAS_SHARED, BINS - 1)
            counts += tl.histogram(slot, BINS)
    counts = tl.where(bins < num_slots, counts, 0)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + bins, ends - padded)
    total = tl.sum(padded, 0)
    tl.store(num_post_ptr, total)
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first_row = blocks * block_m
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(first_row < total, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)
    if not COUNTED:
        for p0 in range(0, num_blocks * block_m, BLOCK):
            pos = p0 + tl.arange(0, BLOCK)
            tl.store(sorted_ids_ptr + pos, tl.full((BLOCK,), 0, tl.int32) + num_pairs,
                     mask=pos < num_blocks * block_m)
    if SCATTER:
        tl.debug_barrier()
        for start in range(0, num_pairs, BLOCK):
            _scatter_pairs(ids_ptr, sorted_ids_ptr, cursor_ptr, start + tl.arange(0, BLOCK),
                           num_pairs, num_choices, top_k, first_expert, num_experts, num_slots,
                           HAS_SHARED, BINS)


# sizes that change from step to step are not specialised on (no recompiles mid-serving)
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_plan_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_post_ptr, cursor_ptr,
                       num_pairs, num_choices, top_k, first_expert, num_experts, num_slots,
                       num_blocks, block_m,
                       HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
                       BLOCK_B: tl.constexpr, SCATTER: tl.constexpr, COUNTED: tl.constexpr):
    """Single program: `_align_plan`."""
    _align_plan(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_post_ptr, cursor_ptr, num_pairs,
                num_choices, top_k, first_expert, num_experts, num_slots, num_blocks, block_m,
                HAS_SHARED, BLOCK, BINS, BLOCK_B, SCATTER, COUNTED)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_count_kernel(ids_ptr, counts_ptr, num_pairs, num_choices, top_k, first_expert, num_experts,
                        HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """The per-slot counts of one BLOCK of pairs, added into counts [BINS] (zeroed before)."""
    slot = _slot_of(ids_ptr, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), num_pairs, num_choices,
                    top_k, first_expert, num_experts, HAS_SHARED, BINS - 1)
    tl.atomic_add(counts_ptr + tl.arange(0, BINS), tl.histogram(slot, BINS), sem="relaxed")


@triton.jit
def _scatter_pairs(ids_ptr, sorted_ids_ptr, cursor_ptr, idx, num_pairs, num_choices, top_k,
                   first_expert, num_experts, num_slots, HAS_SHARED: tl.constexpr,
                   BINS: tl.constexpr):
    """Each pair idx takes the next free position of its slot's run (order within a run is free)."""
    slot = _slot_of(ids_ptr, idx, num_pairs, num_choices, top_k, first_expert, num_experts,
                    HAS_SHARED, BINS - 1)
    keep = slot < num_slots
    pos = tl.atomic_add(cursor_ptr + slot, 1, mask=keep, sem="relaxed")
    tl.store(sorted_ids_ptr + pos, idx, mask=keep)


# sizes that change from step to step are not specialised on (no recompiles mid-serving)
@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(ids_ptr, sorted_ids_ptr, cursor_ptr, num_pairs, num_choices, top_k,
                          first_expert, num_experts, num_slots,
                          HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """The pairs of one BLOCK, placed after the plan (`_scatter_pairs`)."""
    _scatter_pairs(ids_ptr, sorted_ids_ptr, cursor_ptr, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK),
                   num_pairs, num_choices, top_k, first_expert, num_experts, num_slots,
                   HAS_SHARED, BINS)


_ONE_LAUNCH_PAIRS = 2048   # pairs one program plans and places in a single launch
# From this many pairs on, many programs count the pairs and a fill writes the padding, so the
# one planning program only turns counts into offsets (it counted 80K pairs in ~150 µs alone)
_PARALLEL_COUNT_PAIRS = 8192


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int, *, first_expert: int = 0,
              shared_expert: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group (token, choice) pairs by expert and pad each expert's run to a multiple of block_m.

    ids: [T, K] global expert ids; this rank owns [first_expert, first_expert + num_experts),
    other ids are dropped. shared_expert adds a choice k = K per token on slot num_experts, so
    pairs are indexed t * K' + k with K' = K + 1 (K' = K without it).
    Returns
      sorted_ids [B * block_m] int32: pair indices, slot by slot (any order within a slot);
          padding holds T * K';
      expert_ids_per_block [B] int32: the slot of each block, -1 past the padded end;
      num_tokens_post_pad [1] int32: the padded length in use.
    B = max_aligned_blocks(T * K', slots, block_m), fixed by shapes, so the call can sit in a
    CUDA graph. Up to _ONE_LAUNCH_PAIRS pairs (decode) the one-program plan places them too;
    larger batches take a second, many-program scatter; from _PARALLEL_COUNT_PAIRS on, many
    programs also count the pairs first (and a fill writes the padding).
    """
    if block_m < 1:
        raise ValueError(f"block_m={block_m} must be >= 1")
    num_tokens, top_k = ids.shape
    num_choices = top_k + int(shared_expert)
    num_slots = num_experts + int(shared_expert)
    num_pairs = num_tokens * num_choices
    num_blocks = max_aligned_blocks(num_pairs, num_slots, block_m)
    device = ids.device
    ids = ids.contiguous()
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_slots + 1)  # the last bin collects dropped pairs
    cursor = torch.empty(bins, dtype=torch.int32, device=device)
    if num_pairs == 0:
        num_post.zero_()
        return sorted_ids, block_expert, num_post
    args = (first_expert, num_experts, num_slots)
    one_launch = num_pairs <= _ONE_LAUNCH_PAIRS
    counted = num_pairs >= _PARALLEL_COUNT_PAIRS
    if counted:
        cursor.zero_()
        sorted_ids.fill_(num_pairs)
        _align_count_kernel[(triton.cdiv(num_pairs, 1024),)](
            ids, cursor, num_pairs, num_choices, top_k, first_expert, num_experts,
            HAS_SHARED=shared_expert, BLOCK=1024, BINS=bins, num_warps=4)
    _align_plan_kernel[(1,)](ids, sorted_ids, block_expert, num_post, cursor, num_pairs,
                             num_choices, top_k, *args, num_blocks, block_m,
                             HAS_SHARED=shared_expert, BLOCK=1024, BINS=bins, BLOCK_B=32,
                             SCATTER=one_launch, COUNTED=counted, num_warps=4)
    if not one_launch:
        _align_scatter_kernel[(triton.cdiv(num_pairs, 1024),)](
            ids, sorted_ids, cursor, num_pairs, num_choices, top_k, *args,
            HAS_SHARED=shared_expert, BLOCK=1024, BINS=bins, num_warps=4)
    return sorted_ids, block_expert, num_post


# sizes that change from step to step are not specialised on (no recompiles mid-serving)
@triton.jit(do_not_specialize=["num_tokens", "num_pairs", "num_blocks"])
def _route_align_kernel(x_ptr, w_ptr, part_ptr, bias_ptr, weights_ptr, ids_ptr, counter_ptr,
                        sorted_ids_ptr, block_expert_ptr, num_post_ptr, cursor_ptr,
                        num_tokens, hidden, stride_x, k_per_split, scale, num_pairs, num_choices,
                        first_expert, num_local, num_slots, num_blocks, block_m,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        E: tl.constexpr, SPLITS: tl.constexpr, TOP_K: tl.constexpr,
                        HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr,
                        BLOCK_B: tl.constexpr,
                        PDL: tl.constexpr):
    """The router and the MoE alignment in one launch: program (e, s) writes its partial
    logits; the program that finishes last (a counter, reset by it for the next launch) then
    runs the top-k of every token (all at once) and the one-program alignment plan, the same
    code as the three separate kernels."""
    pdl_start(PDL)
    _route_partial(x_ptr, w_ptr, part_ptr, num_tokens, hidden, stride_x, k_per_split, 0,
                   tl.program_id(0), tl.program_id(1), E, BLOCK_T, BLOCK_E, BLOCK_K)
    tl.debug_barrier()            # every thread's partials are written before the release below
    total = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == total - 1:
        tl.debug_barrier()
        # every token at once (BLOCK_T >= num_tokens): a loop over tokens was latency-bound
        _route_topk_rows(part_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, 0, scale,
                         E, SPLITS, TOP_K, BLOCK_T, True)
        tl.debug_barrier()        # the ids are written before the plan reads them
        _align_plan(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_post_ptr, cursor_ptr,
                    num_pairs, num_choices, TOP_K, first_expert, num_local, num_slots,
                    num_blocks, block_m, HAS_SHARED, BLOCK, BINS, BLOCK_B, True, False)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")


_counters: dict = {}


# The one-launch route + align hands the top-k of every token and the alignment plan to one
# program, which takes every token's top-k at once (scripts/decode_kernels_bench.py
# route_align, H100, 128 experts, top 4 + shared, hidden 6144, µs against the three kernels):
# 10.4 / 11.1 / 12.3 / 18.2 against 12.6 / 12.9 / 14.8 / 19.5 at 1 / 2 / 4 / 8 tokens, 27.6 /
# 28.9 against 26.0 / 27.2 at 12 / 16 (one token after another it lost from 2 tokens on). At
# one TP 8 rank the batch-4 decode step took 6.89 ms against 7.04, batch 16 12.60 against
# 12.25. M3SERVE_ROUTE_ALIGN_MAX_TOKENS overrides, for A/B runs.
ROUTE_ALIGN_MAX_TOKENS = 8 if envs.ROUTE_ALIGN_MAX_TOKENS is None else envs.ROUTE_ALIGN_MAX_TOKENS


def route_align_eligible(x: torch.Tensor, num_experts: int, top_k: int) -> bool:
    """Batches `moe_route_align` takes (at most 16 tokens, one token tile of the router)."""
    return ((x.is_cuda or _INTERPRET) and 0 < x.shape[0] <= 16 and x.stride(1) == 1
            and num_experts == triton.next_power_of_2(num_experts) and num_experts <= 256
            and top_k == triton.next_power_of_2(top_k) and 0 < top_k <= num_experts)


def moe_route_align(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                    routed_scaling_factor: float, num_experts: int, block_m: int, *,
                    first_expert: int = 0, shared_expert: bool = False):
    """`moe_route` then `moe_align(ids, num_experts, block_m, first_expert=, shared_expert=)` in
    one launch, for `route_align_eligible` batches (decode: at most 16 tokens). Returns
    (weights [T, K] fp32, ids [T, K] int32, (sorted_ids, expert_ids_per_block,
    num_tokens_post_pad, block_m)): the same weights and ids as `moe_route` (the same sums in
    the same order) and an alignment under `moe_align`'s contract. Launches on one device must
    not overlap (they share one counter, which the last program resets).
    The MoE layer takes it for batches of up to `ROUTE_ALIGN_MAX_TOKENS` tokens."""
    num_tokens, hidden = x.shape
    num_all = gate_weight.shape[0]
    if not route_align_eligible(x, num_all, top_k):
        raise ValueError(f"moe_route_align takes 1-16 tokens with unit-stride rows, a power-of-two "
                         f"expert count <= 256 and top_k; got x {tuple(x.shape)}, {num_all} "
                         f"experts, top_k {top_k}")
    w, b = gate_weight.float().contiguous(), bias.float().contiguous()
    block_t, block_e, block_k, splits = route_tiles(num_tokens, num_all, hidden)
    k_per_split = triton.cdiv(triton.cdiv(hidden, splits), block_k) * block_k
    device = x.device
    part = torch.empty(splits, num_tokens, num_all, dtype=torch.float32, device=device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    num_choices = top_k + int(shared_expert)
    num_slots = num_experts + int(shared_expert)
    num_pairs = num_tokens * num_choices
    num_blocks = max_aligned_blocks(num_pairs, num_slots, block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_slots + 1)
    cursor = torch.empty(bins, dtype=torch.int32, device=device)
    counter = _counters.get(device)
    if counter is None:
        counter = _counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    pdl = pdl_enabled(x)
    _route_align_kernel[(num_all // block_e, splits)](
        x, w, part, b, weights, ids, counter, sorted_ids, block_expert, num_post, cursor,
        num_tokens, hidden, x.stride(0), k_per_split, routed_scaling_factor, num_pairs,
        num_choices, first_expert, num_experts, num_slots, num_blocks, block_m,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, E=num_all, SPLITS=splits,
        TOP_K=top_k, HAS_SHARED=shared_expert, BLOCK=1024, BINS=bins, BLOCK_B=32, PDL=pdl, num_warps=4,
        **launch_options(pdl))
    return weights, ids, (sorted_ids, block_expert, num_post, block_m)


def decode_block_m(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> int:
    """The BLOCK_M `fused_moe` aligns to for this many tokens (its tile table's choice)."""
    return get_config(triton.cdiv(num_tokens * top_k, num_experts), 16, 16, dtype)["BLOCK_M"]


def _config(block_m, block_n, block_k, group_m, num_warps, num_stages, tma=False,
            reduce_sum=False, split_k=1) -> dict:
    """A tile config: TMA = weight tiles through tensor descriptors; SUM = the down GEMM stores
    expert outputs for one summing pass (`fused_moe`'s reduce=None follows it); SPLIT_K (a
    gate_up config's) = K ranges of the gate_up GEMM run as separate programs, their partial
    sums added by one more small kernel that applies SwiGLU (not with FP8 activations or TMA)."""
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m,
            "num_warps": num_warps, "num_stages": num_stages, "TMA": tma, "SUM": reduce_sum,
            "SPLIT_K": split_k}


# Tile regimes whose weight tiles load through tensor descriptors (TMA), by weight dtype, and
# those whose down GEMM stores each expert's output for one summing pass instead of adding it
# atomically (`fused_moe`'s reduce=None). Measured on an H200, 4 routed + shared expert,
# balanced routing (scripts/decode_kernels_bench.py moe_tma, moe_tma_regimes), µs:
#   bf16 16384 tokens: TMA + sum 18683, per-thread loads + sum 19931, loads + atomic 21521;
#   bf16 2048 / 1087 tokens (64-row tiles): TMA + sum 4731 / 3919, loads + atomic 4860 / 4208;
#   fp8 16384 / 8192 tokens: loads + sum 11474 / 6431, atomic 11785 / 6480, TMA + sum 11195 /
#   6453 (not adopted: no clear gain); fp8 2048 tokens: atomic 2576, sum 2785.
TMA_REGIMES = {torch.bfloat16: ("large", "largest"), torch.float8_e4m3fn: ()}
SUM_REGIMES = {torch.bfloat16: ("large", "largest"), torch.float8_e4m3fn: ("largest",)}


# Rows per routed expert where `get_config` changes tiles (each regime is its own compiled
# variant of both GEMMs). Measured on an H200, bf16, 4 routed + shared expert, balanced routing
# (scripts/decode_kernels_bench.py moe_bounds): the 64-row tiles beat the 32-row ones from
# about 24 rows per expert (3874 vs 4205 us at 26, 4018 vs 5394 at 34: a mixed step's prefill
# chunk beside the decodes), and the 128-row tiles beat the 64-row ones above about 80 (5668 vs
# 6192 us at 96). FP8 skips the 32-row tiles: its 64-row ones are faster from 14 rows on (1856
# vs 2166 us at 14, 2042 vs 3669 at 34), and the 128-row ones from about 80 (3042 vs 3330 at 96).
TILE_REGIMES = {torch.bfloat16: (16, 24, 80), torch.float8_e4m3fn: (16, 16, 80)}


# Decode tiles for one TP rank's experts (width I <= NARROW_WIDTH: 384 at TP 8, 768 at TP 4),
# by FP8: 5 experts x 768 gate_up columns in 64-column tiles are 60 programs for 132 SMs, so
# the gate_up tiles narrow to 32 columns, and the down GEMM's short K (I) takes wider output
# tiles. Picked on an H200 by a coordinate search at 1 / 4 / 16 tokens, 4 routed of 128 + the
# shared expert (scripts/decode_kernels_bench.py rank_moe; docs/performance.md has its best
# pairs); measured where it counts, one TP rank's 60-layer model at 8K context (bench offline,
# TPOT ms at batch 1 / 4 / 16): TP 8 bf16 5.18 / 7.01 / 14.73 -> 4.60 / 6.86 / 14.42, TP 8 FP8
# 5.78 / 6.90 / 13.11 -> 5.34 / 6.80 / 11.48, TP 4 FP8 6.45 / 8.75 / 16.62 -> 5.95 / 8.63 / 16.49.
NARROW_WIDTH = 1024
NARROW_GATE_UP = {False: _config(16, 32, 128, 1, 4, 5), True: _config(16, 32, 256, 1, 4, 3)}
NARROW_DOWN = {False: _config(16, 128, 128, 1, 4, 3), True: _config(16, 64, 128, 1, 4, 4)}
# Packed experts (codes dequantised to bf16 tiles): the down GEMM's K steps shorten to 64; the
# gate_up tiles stay the bf16 ones, which a sweep did not beat (H200, one TP 8 rank's experts,
# 4 of 128 + shared, scripts/decode_kernels_bench.py rank_packed, µs at 1 / 4 / 16 tokens:
# MXFP4 71.4 / 130.1 / 303.8 -> 68.7 / 120.6 / 286.4, MXFP8 41.6 / 75.7 / 173.2 -> 39.3 / 65.7 / 146.8)
PACKED_NARROW_DOWN = _config(16, 128, 64, 1, 4, 3)


# Split K of the packed experts' decode gate_up GEMM (SPLIT_K 0 in a config: by step size).
# Dequantising in registers makes those tiles instruction bound, and one TP rank's narrow
# experts give few programs (5 experts x 12 column tiles at one token), so the K ranges run as
# separate programs until a step has about this many (FP4 codes with fp32 scales, NVFP4's, cost
# the most instructions and want more). Measured on an H200 (scripts/decode_kernels_bench.py
# rank_packed, one TP 8 rank's experts, 4 of 128 + shared, gate_up + down µs at 1 / 4 / 16
# tokens): MXFP4 47.2 / 83.0 / 145.7 unsplit -> 26.7 (split 4) / 65.2 (8) / 142.4 (1); NVFP4
# 66.3 / 108.2 / 256.9 -> 33.2 (8) / 83.3 (8) / 229.8 (4); MXFP8 41.3 / 72.4 / 172.1 -> 29.2
# (8) / 62.9 (4) / 148.0 (2). bf16 experts gain nothing from it (32.5 -> 32.4 at split 2).
SPLIT_PROGRAMS = {2: 2048, 3: 4096, 1: 2048}
MAX_SPLIT = 8


def decode_split(num_tokens: int, top_k: int, num_experts: int, inter: int, block_n: int,
                 shared: bool, pack: int) -> int:
    """The gate_up GEMM's split K for a step of num_tokens (packed experts, format code `pack`):
    doubled while the expected programs (experts hit, times column tiles, times the split) stay
    within SPLIT_PROGRAMS; a function of the step size only, so each CUDA-graph size has one."""
    programs = (min(num_tokens * top_k, num_experts) + int(shared)) * triton.cdiv(inter, block_n)
    split = 1
    while split < MAX_SPLIT and programs * split * 2 <= SPLIT_PROGRAMS[pack]:
        split *= 2
    return split


def tile_regimes(dtype: torch.dtype) -> tuple[int, int, int]:
    """The (small, medium, large) row bounds of `get_config` for weights of `dtype`."""
    return TILE_REGIMES.get(dtype, TILE_REGIMES[torch.bfloat16])


def split_token_counts(num_experts: int, top_k: int, inter: int, shared: bool, pack: int,
                       max_tokens: int) -> list[int]:
    """The smallest step size of each split K `decode_split` picks for packed experts of width
    `inter` (what a warm-up runs so no split variant compiles while serving)."""
    block_n = get_config(1, inter, 1 << 20, torch.bfloat16, True, packed=True)["BLOCK_N"]
    first = {}
    for t in range(1, max_tokens + 1):
        first.setdefault(decode_split(t, top_k, num_experts, inter, block_n, shared, pack), t)
        if t * top_k >= num_experts:          # every expert hit: the split stops changing
            break
    return sorted(first.values())


def regime_token_counts(num_experts: int, top_k: int, max_tokens: int,
                        dtype: torch.dtype = torch.bfloat16) -> list[int]:
    """A step size in every tile regime up to max_tokens tokens: each regime's largest, and
    max_tokens itself (what a start-up warm-up runs so serving compiles no new tiles).
    num_experts: the experts of this call (this rank's under EP); top_k: (token, choice) pairs
    per step token (times the DP replicas whose tokens the MoE layers gather); dtype: the
    experts' weight dtype."""
    counts = [bound * num_experts // top_k for bound in tile_regimes(dtype)]
    return sorted({max(1, min(c, max_tokens)) for c in counts} | {max_tokens})


def get_config(M: int, N: int, K: int, dtype: torch.dtype, gate_up: bool = False,
               packed: bool = False) -> dict:
    """Tile config for one grouped GEMM (no autotuning: a small table by regime).

    M: average rows per routed expert (T * top_k / E); N: output columns the GEMM tiles (I for
    gate_up, H for down); K: reduction size; dtype: weight dtype; gate_up: the tile holds a gate
    and an up accumulator, so FP8's wide prefill tiles halve BLOCK_N (bf16 measured faster
    without halving on an H200, 4 routed + shared expert, scripts/decode_kernels_bench.py
    prefill_moe). BLOCK_M depends on M only,
    because both GEMMs share one alignment. Decode (few rows per expert) is weight-bandwidth
    bound: a 16-row tile, long K steps and deep pipelining; prefill is compute bound: 64/128-row
    tiles in L2-friendly groups. packed: the weights are packed codes, dequantised to tiles of
    `dtype` (bf16) in registers (their narrow decode gate_up tiles split K by step size).
    """
    if _INTERPRET:
        return _config(16, 32, 32, 1, 4, 1)
    fp8 = dtype == torch.float8_e4m3fn
    small, medium, large = tile_regimes(dtype)
    if M <= small and gate_up and N <= NARROW_WIDTH:   # one TP rank's experts: narrow tiles
        regime, cfg = "small", dict(NARROW_GATE_UP[fp8])
        cfg["SPLIT_K"] = 0 if packed else 1           # packed: `decode_split` by step size
    elif M <= small and not gate_up and K <= NARROW_WIDTH:
        regime, cfg = "small", dict(PACKED_NARROW_DOWN if packed else NARROW_DOWN[fp8])
    elif M <= small:   # bf16: 3 stages beat 4 (143 vs 151 µs for 5 experts at 1 token, H200)
        regime, cfg = "small", _config(16, 64, 256 if fp8 else 128, 1, 4, 4 if fp8 else 3)
    elif M <= medium:
        regime, cfg = "medium", _config(32, 64, 256 if fp8 else 128, 4, 4, 4)
    elif M <= large:   # bf16 with 8 warps and an unhalved gate_up: 4717 vs 4832 µs at 2048 tokens
        regime, cfg = "large", _config(64, 128, 128, 8, 4, 4) if fp8 else _config(64, 128, 64, 8, 8, 4)
    else:            # bf16 unhalved gate_up: 12053 vs 12220 µs at 8192 tokens
        regime, cfg = "largest", _config(128, 128, 128 if fp8 else 64, 8, 8, 3)
        if not fp8 and not gate_up:   # TMA down GEMM: 18683 vs 19249 us at 16384 tokens
            cfg["BLOCK_N"] = 256
    if gate_up and fp8 and cfg["BLOCK_M"] >= 64:   # FP8 prefill: not measured unhalved
        cfg["BLOCK_N"] //= 2
    cfg["TMA"] = regime in TMA_REGIMES.get(dtype, ())
    cfg["SUM"] = regime in SUM_REGIMES.get(dtype, ())
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], max(16, triton.next_power_of_2(N)))
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(16, triton.next_power_of_2(K)))
    return cfg


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, min_scale,
                       BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr,
                       PDL: tl.constexpr):
    """One program per row: s = max(amax / 448, min_scale), q = e4m3(x / s), ties to even (the
    interpreter's own cast mis-rounds, so SOFT_ROUND rounds in fp32 first: `cast_rne`)."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, min_scale)
    q = cast_rne(tl.clamp(x / scale, -448.0, 448.0), q_ptr.dtype.element_ty, SOFT_ROUND)
    tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
    tl.store(s_ptr + row, scale)


def quant_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic FP8 quantisation. x: [R, C] -> (e4m3 [R, C], scales [R] fp32)."""
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        pdl = pdl_enabled(x)
        _quant_rows_kernel[(rows,)](x, q, s, cols, x.stride(0), q.stride(0), FP8_MIN_SCALE,
                                    BLOCK=block, SOFT_ROUND=_INTERPRET,
                                    PDL=pdl, num_warps=8 if block >= 2048 else 4, **launch_options(pdl))
    return q, s


@triton.jit
def _tile_ids(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row blocks (mostly the same few experts) sweep the N tiles
    together, so an expert's weight tile and the gathered activation rows are reused from L2."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _expert_operands(expert, num_experts, w_ptr, w_scale_ptr, ws_ptr, ws_scale_ptr, stride_we,
                     stride_se, stride_wn, stride_wsn, inter, inter_shared):
    """(weight base, scale base, row stride, intermediate size) of routed expert `expert`, or of
    the shared expert when `expert == num_experts` (its weights are separate tensors)."""
    if expert == num_experts:
        w_base = ws_ptr
        scale_base = ws_scale_ptr
        stride_n = stride_wsn
        n_inter = inter_shared
    else:
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        scale_base = w_scale_ptr + expert.to(tl.int64) * stride_se
        stride_n = stride_wn
        n_inter = inter
    return w_base, scale_base, stride_n, n_inter


@triton.jit
def _packed_rows(expert, num_experts, g_ptr, gs_ptr, stride_ge, stride_sn, stride_ssn):
    """(global-scale base, block-scale row stride) of routed expert `expert` or of the shared
    expert (`expert == num_experts`), for packed weights."""
    if expert == num_experts:
        g_base = gs_ptr
        stride_s = stride_ssn
    else:
        g_base = g_ptr + expert.to(tl.int64) * stride_ge
        stride_s = stride_sn
    return g_base, stride_s


@triton.jit
def _clear_chunk(ptr, numel, chunk):
    """Zero fp32 elements [pid * chunk, (pid + 1) * chunk) of ptr[numel] (chunk: multiple of 1024)."""
    start = tl.program_id(0).to(tl.int64) * chunk
    for z0 in range(0, chunk, 1024):
        offs = start + z0 + tl.arange(0, 1024)
        tl.store(ptr + offs, tl.zeros((1024,), dtype=tl.float32), mask=offs < numel)


@triton.jit
def _swiglu(acc_g, acc_u, alpha, limit):
    """SwiGLU-OAI of fp32 gate / up pre-activations (one formula for both places it runs)."""
    gate = tl.minimum(acc_g, limit)
    up = tl.clamp(acc_u, -limit, limit)
    return gate * tl.sigmoid(alpha * gate) * (up + 1.0)


@triton.jit(do_not_specialize=["num_rows"])
def _split_swiglu_kernel(part_ptr, h_ptr, num_post_ptr, num_rows, inter_max, part_stride,
                         stride_h, alpha, limit, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr,
                         PDL: tl.constexpr):
    """h [rows, I_max] = SwiGLU of the split gate_up GEMM's fp32 partial sums at part_ptr
    [SPLIT, rows, 2 I_max] (gate at column n, up at I_max + n), added in split order (the same
    sum on every run), rounded to h's dtype as the unsplit GEMM stores it. Rows past the
    aligned count are skipped; rows of blocks the GEMM skipped come out as garbage nobody reads."""
    pdl_start(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R >= tl.load(num_post_ptr):
        return
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < num_rows)[:, None] & (c < inter_max)[None, :]
    ptrs = part_ptr + r[:, None].to(tl.int64) * (2 * inter_max) + c[None, :]
    g = tl.load(ptrs, mask=ok, other=0.0)
    u = tl.load(ptrs + inter_max, mask=ok, other=0.0)
    for sp in tl.static_range(1, SPLIT):
        g += tl.load(ptrs + sp * part_stride, mask=ok, other=0.0)
        u += tl.load(ptrs + sp * part_stride + inter_max, mask=ok, other=0.0)
    h = _swiglu(g, u, alpha, limit)
    tl.store(h_ptr + r[:, None].to(tl.int64) * stride_h + c[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok)


# sizes that change from step to step are not specialised on (no recompiles mid-serving)
@triton.jit(do_not_specialize=["num_pid_m", "num_rows", "zero_numel", "zero_chunk"])
def _gemm1_swiglu_kernel(
        x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, ws_ptr, ws_scale_ptr, h_ptr,
        sorted_ids_ptr, block_expert_ptr, num_post_ptr, num_pid_m, num_pid_n,
        num_rows, num_choices, hidden, inter, inter_shared, num_experts,
        stride_xt, stride_we, stride_wn, stride_wsn, stride_se, stride_h,
        alpha, limit, zero_ptr, zero_numel, zero_chunk,
        g_ptr, gs_ptr, stride_ge, stride_sn, stride_ssn, part_ptr, part_stride, inter_max,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, USE_FP8: tl.constexpr,
        UPCAST: tl.constexpr, ZERO: tl.constexpr, TMA: tl.constexpr,
        PACK: tl.constexpr = 0, GDIV: tl.constexpr = True, SPLIT: tl.constexpr = 1,
        PDL: tl.constexpr = False):
    """h[p, n] = SwiGLU-OAI(x[t] . w13[e, n], x[t] . w13[e, I_e + n]) for one [BLOCK_M, BLOCK_N]
    tile of expert e's aligned rows p, each holding pair t * K' + k (K' = num_choices).
    With ZERO every program first clears its chunk of the down GEMM's fp32 atomic target (one
    launch fewer than a separate fill; the down GEMM runs after this kernel). TMA: the weight
    tiles come through a tensor descriptor of the expert's [2 I_e, H] matrix (Hopper's bulk
    copy engine) instead of per-thread loads. PACK (1 MXFP8, 2 MXFP4, 3 NVFP4): w13 (and the
    shared w13) are codes with block scales at w_scale_ptr / ws_scale_ptr ([.., 2 I, H / B],
    row strides stride_sn / stride_ssn) and NVFP4 global scales at g_ptr [E, 2 I] / gs_ptr,
    dequantised in registers to x's dtype (`kernels/packed_gemm.py`). SPLIT > 1 (split K, for
    decode steps' few programs): grid axis 1 picks a K range, and the fp32 gate / up partial
    sums go to part_ptr [SPLIT, rows, 2 I_max] (row stride 2 I_max); `_split_swiglu_kernel`
    adds them and writes h."""
    pdl_start(PDL)
    pid_k = tl.program_id(1)
    if ZERO:
        if pid_k == 0:
            _clear_chunk(zero_ptr, zero_numel, zero_chunk)
    pid_m, pid_n = _tile_ids(num_pid_m, num_pid_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    w_base, scale_base, stride_n, n_inter = _expert_operands(
        expert, num_experts, w_ptr, w_scale_ptr, ws_ptr, ws_scale_ptr, stride_we, stride_se,
        stride_wn, stride_wsn, inter, inter_shared)
    if pid_n * BLOCK_N >= n_inter:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    row_ok = rows < num_rows
    tokens = (rows // num_choices).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_n + offs_k[:, None]
    u_ptrs = g_ptrs + n_inter.to(tl.int64) * stride_n
    if TMA:   # rows past 2 I_e read as zero; a gate tile's columns past I_e are never stored
        w_desc = tl.make_tensor_descriptor(w_base, shape=[2 * n_inter, hidden],
                                           strides=[stride_n, 1], block_shape=[BLOCK_N, BLOCK_K])
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PACK > 0:
        g_base, stride_s = _packed_rows(expert, num_experts, g_ptr, gs_ptr, stride_ge,
                                        stride_sn, stride_ssn)
        x_rows = x_ptr + tokens[:, None] * stride_xt
        u_codes = w_base + n_inter.to(tl.int64) * stride_n
        u_scales = scale_base + n_inter.to(tl.int64) * stride_s
    k_steps = tl.cdiv(hidden, BLOCK_K)
    k_first = 0
    if SPLIT > 1:
        per_split = tl.cdiv(k_steps, SPLIT)
        k_first = pid_k * per_split
        k_steps = tl.minimum(k_steps, k_first + per_split)
        a_ptrs += k_first * BLOCK_K
        g_ptrs += k_first * BLOCK_K
        u_ptrs += k_first * BLOCK_K
    for k in range(k_first, k_steps):
        k_ok = offs_k < hidden - k * BLOCK_K
        if PACK > 1:
            g0, g1 = fp4_tiles(w_base, scale_base, g_base, stride_n, stride_s, offs_n, n_ok,
                               k * BLOCK_K, hidden, BLOCK_K, BLOCK_N, PACK == 3, GDIV,
                               x_ptr.dtype.element_ty, UPCAST)
            u0, u1 = fp4_tiles(u_codes, u_scales, g_base + n_inter, stride_n, stride_s, offs_n,
                               n_ok, k * BLOCK_K, hidden, BLOCK_K, BLOCK_N, PACK == 3, GDIV,
                               x_ptr.dtype.element_ty, UPCAST)
            a0, a1 = even_odd_columns(x_rows, row_ok, k * BLOCK_K, hidden, BLOCK_K)
            if UPCAST:
                a0, a1 = a0.to(tl.float32), a1.to(tl.float32)
                g0, g1 = g0.to(tl.float32), g1.to(tl.float32)
                u0, u1 = u0.to(tl.float32), u1.to(tl.float32)
            acc_g = tl.dot(a1, g1, tl.dot(a0, g0, acc_g))
            acc_u = tl.dot(a1, u1, tl.dot(a0, u0, acc_u))
        else:
            if PACK == 1:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                g = mxfp8_tile(w_base, scale_base, stride_n, stride_s, offs_n, n_ok, k * BLOCK_K,
                               hidden, BLOCK_K, BLOCK_N, x_ptr.dtype.element_ty, UPCAST)
                u = mxfp8_tile(u_codes, u_scales, stride_n, stride_s, offs_n, n_ok, k * BLOCK_K,
                               hidden, BLOCK_K, BLOCK_N, x_ptr.dtype.element_ty, UPCAST)
            else:
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                if TMA:
                    g = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
                    u = w_desc.load([n_inter + pid_n * BLOCK_N, k * BLOCK_K]).T
                elif EVEN_K:
                    g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
                    u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
                else:
                    g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                    u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                g = g.to(tl.float32)
                u = u.to(tl.float32)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if USE_FP8:
        sx = tl.load(x_scale_ptr + tokens, mask=row_ok, other=0.0)
        sg = tl.load(scale_base + offs_n, mask=n_ok, other=0.0)
        su = tl.load(scale_base + n_inter + offs_n, mask=n_ok, other=0.0)
        acc_g = acc_g * sx[:, None] * sg[None, :]
        acc_u = acc_u * sx[:, None] * su[None, :]
    if SPLIT > 1:
        p_ptrs = (part_ptr + pid_k.to(tl.int64) * part_stride
                  + offs_m[:, None].to(tl.int64) * (2 * inter_max) + offs_n[None, :])
        tl.store(p_ptrs, acc_g, mask=n_ok[None, :])
        tl.store(p_ptrs + inter_max, acc_u, mask=n_ok[None, :])
    else:
        h = _swiglu(acc_g, acc_u, alpha, limit)
        h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_h + offs_n[None, :]
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])


# sizes that change from step to step are not specialised on (no recompiles mid-serving)
@triton.jit(do_not_specialize=["num_pid_m", "num_rows"])
def _gemm2_kernel(
        h_ptr, h_scale_ptr, w_ptr, w_scale_ptr, ws_ptr, ws_scale_ptr, out_ptr, weights_ptr,
        sorted_ids_ptr, block_expert_ptr, num_post_ptr, num_pid_m, num_pid_n,
        num_rows, num_choices, top_k, hidden, inter, inter_shared, num_experts,
        stride_h, stride_we, stride_wn, stride_wsn, stride_se, stride_out,
        g_ptr, gs_ptr, stride_ge, stride_sn, stride_ssn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, USE_FP8: tl.constexpr,
        UPCAST: tl.constexpr, ATOMIC: tl.constexpr, TMA: tl.constexpr,
        PACK: tl.constexpr = 0, GDIV: tl.constexpr = True, PDL: tl.constexpr = False):
    """y = h[p] . w2[e, n] for pair t * K' + k at aligned row p. ATOMIC adds routing_weight * y
    into out[t, n] (fp32; the shared choice k == top_k has weight 1.0); otherwise y itself is
    stored, rounded to out's dtype, at out[t * K' + k, n] for `_moe_sum_kernel`. TMA: the h and
    weight tiles come through tensor descriptors. PACK: packed w2 as in `_gemm1_swiglu_kernel`
    (block scales [.., H, I / B]), h read as it is."""
    pdl_start(PDL)
    pid_m, pid_n = _tile_ids(num_pid_m, num_pid_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    w_base, scale_base, stride_n, k_inter = _expert_operands(
        expert, num_experts, w_ptr, w_scale_ptr, ws_ptr, ws_scale_ptr, stride_we, stride_se,
        stride_wn, stride_wsn, inter, inter_shared)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    row_ok = rows < num_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_h + offs_k[None, :]
    b_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_n + offs_k[:, None]
    if TMA:   # columns past I_e read as zero in both operands
        h_desc = tl.make_tensor_descriptor(h_ptr, shape=[num_pid_m * BLOCK_M, k_inter],
                                           strides=[stride_h, 1], block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_base, shape=[hidden, k_inter],
                                           strides=[stride_n, 1], block_shape=[BLOCK_N, BLOCK_K])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PACK > 0:
        g_base, stride_s = _packed_rows(expert, num_experts, g_ptr, gs_ptr, stride_ge,
                                        stride_sn, stride_ssn)
        h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_h
    for k in range(tl.cdiv(k_inter, BLOCK_K)):
        if PACK > 1:
            b0, b1 = fp4_tiles(w_base, scale_base, g_base, stride_n, stride_s, offs_n, n_ok,
                               k * BLOCK_K, k_inter, BLOCK_K, BLOCK_N, PACK == 3, GDIV,
                               h_ptr.dtype.element_ty, UPCAST)
            a0, a1 = even_odd_columns(h_rows, row_ok, k * BLOCK_K, k_inter, BLOCK_K)
            if UPCAST:
                a0, a1 = a0.to(tl.float32), a1.to(tl.float32)
                b0, b1 = b0.to(tl.float32), b1.to(tl.float32)
            acc = tl.dot(a1, b1, tl.dot(a0, b0, acc))
        else:
            if PACK == 1:
                k_ok = offs_k < k_inter - k * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = mxfp8_tile(w_base, scale_base, stride_n, stride_s, offs_n, n_ok, k * BLOCK_K,
                               k_inter, BLOCK_K, BLOCK_N, h_ptr.dtype.element_ty, UPCAST)
            elif TMA:
                a = h_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
                b = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
            elif EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < k_inter - k * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if USE_FP8:
        sh = tl.load(h_scale_ptr + offs_m)
        sw = tl.load(scale_base + offs_n, mask=n_ok, other=0.0)
        acc = acc * sh[:, None] * sw[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tokens = rows // num_choices
        choice = rows % num_choices
        routed = row_ok & (choice < top_k)
        route_w = tl.load(weights_ptr + tokens * top_k + choice, mask=routed, other=1.0)
        acc = acc * route_w[:, None]
        tokens = tokens.to(tl.int64)
        out_ptrs = out_ptr + tokens[:, None] * stride_out + offs_n[None, :]
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
    else:
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# sizes that change from step to step are not specialised on (no recompiles mid-serving)
@triton.jit(do_not_specialize=["num_tokens"])
def _moe_sum_kernel(y_ptr, weights_ptr, ids_ptr, extra_ptr, out_ptr, num_tokens, hidden, top_k,
                    num_choices, first_expert, num_experts, stride_y, stride_extra, stride_out,
                    BLOCK_H: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_EXTRA: tl.constexpr):
    """out[t] = sum_k weights[t, k] * y[t * K' + k] over the choices this rank owns (+ the shared
    row t * K' + K with weight 1, + extra[t]), in fp32, choices in order; one program per
    (token, BLOCK_H columns). Rows of other ranks' experts were never written and are not read."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(top_k):
        local = tl.load(ids_ptr + t * top_k + k).to(tl.int32) - first_expert
        if (local >= 0) & (local < num_experts):
            w = tl.load(weights_ptr + t * top_k + k)
            acc += w * tl.load(y_ptr + (t * num_choices + k) * stride_y + cols, mask=ok,
                               other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(y_ptr + (t * num_choices + top_k) * stride_y + cols, mask=ok,
                       other=0.0).to(tl.float32)
    if HAS_EXTRA:
        acc += tl.load(extra_ptr + t * stride_extra + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _check_packed(x, w13, w2, w13_scale, w2_scale, globals_, shared, kind):
    """Shapes of packed expert stacks (codes [E, 2I, H / per_byte], [E, H, I / per_byte],
    block scales [E, 2I, H / B], [E, H, I / B], NVFP4 global scales [E, 2I], [E, H]) and of
    the shared expert's (the same without E)."""
    fmt = PACK_CODES.get(kind)
    if fmt is None:
        raise ValueError(f"packed={kind!r}: unknown format ({', '.join(PACK_CODES)})")
    per_byte, block = (1 if fmt == 1 else 2), SCALE_BLOCK[fmt]
    hidden = x.shape[1] if x.dim() == 2 else -1
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"x must be [T, H], w13 codes [E, 2I, H/{per_byte}], w2 codes "
                         f"[E, H, I/{per_byte}]; got {tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_inter = w13.shape[:2]

    def expect(t, shape, what):
        if t is None or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{kind} {what} must be {list(shape)}, got "
                             f"{None if t is None else tuple(t.shape)}")

    def stack(lead, n13, n2, k13, k2, t13, t2, s13, s2, g13, g2, what):
        for k in (k13, k2):
            if k % block:
                raise ValueError(f"{kind} {what}: reduction width {k} is not a multiple of {block}")
        expect(t13, (*lead, n13, k13 // per_byte), f"{what} w13 codes")
        expect(t2, (*lead, n2, k2 // per_byte), f"{what} w2 codes")
        expect(s13, (*lead, n13, k13 // block), f"{what} w13 block scales")
        expect(s2, (*lead, n2, k2 // block), f"{what} w2 block scales")
        if fmt == 3:
            expect(g13, (*lead, n13), f"{what} w13 global scales")
            expect(g2, (*lead, n2), f"{what} w2 global scales")

    stack((num_experts,), two_inter, hidden, hidden, two_inter // 2, w13, w2, w13_scale, w2_scale,
          *globals_, "experts'")
    if shared is not None:
        if len(shared) != (6 if fmt == 3 else 4):
            raise ValueError(f"shared must be (w13, w2, w13_scale, w2_scale"
                             f"{', w13_global, w2_global' if fmt == 3 else ''}) for {kind}; got "
                             f"{len(shared)} tensors")
        n_s = shared[0].shape[0]
        stack((), n_s, hidden, hidden, n_s // 2, *shared[:4],
              *(shared[4:] if fmt == 3 else (None, None)), "shared expert's")


def _check_inputs(x, w13, w2, weights, ids, w13_scale, w2_scale, shared):
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got x {tuple(x.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    num_experts, two_inter, hidden = w13.shape
    if x.shape[1] != hidden or two_inter % 2 or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"inconsistent shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if weights.shape != ids.shape or weights.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be "
                         f"[T={x.shape[0]}, K]")
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8 != (w2.dtype == torch.float8_e4m3fn) or fp8 != (w13_scale is not None) \
            or fp8 != (w2_scale is not None):
        raise ValueError(f"w13 {w13.dtype} / w2 {w2.dtype}: FP8 weights need both w13_scale and "
                         f"w2_scale, bf16 weights neither")
    if fp8 and (w13_scale.shape != (num_experts, two_inter)
                or w2_scale.shape != (num_experts, hidden)):
        raise ValueError(f"w13_scale {tuple(w13_scale.shape)} must be [E, 2I] and w2_scale "
                         f"{tuple(w2_scale.shape)} [E, H]")
    if shared is not None:
        if len(shared) != (4 if fp8 else 2):
            raise ValueError(f"shared must be (w13, w2) or, for FP8, (w13, w2, w13_scale, "
                             f"w2_scale); got {len(shared)} tensors")
        s13, s2 = shared[0], shared[1]
        if s13.dim() != 2 or s13.shape[1] != hidden or s13.shape[0] % 2 \
                or s2.shape != (hidden, s13.shape[0] // 2):
            raise ValueError(f"shared w13 {tuple(s13.shape)} must be [2I_s, H={hidden}] and w2 "
                             f"{tuple(s2.shape)} [H, I_s]")
        if s13.dtype != w13.dtype or s2.dtype != w2.dtype:
            raise ValueError(f"shared weights {s13.dtype}/{s2.dtype} must match the experts' "
                             f"{w13.dtype}/{w2.dtype}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,
              shared: tuple[torch.Tensor, ...] | None = None, out: torch.Tensor | None = None,
              first_expert: int = 0, reduce: str | None = None, extra: torch.Tensor | None = None,
              config: dict | tuple[dict, dict] | None = None,
              alignment: tuple | None = None, packed: str | None = None,
              w13_global: torch.Tensor | None = None, w2_global: torch.Tensor | None = None,
              global_divides: bool = True, x_quant: tuple | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * Expert_{ids[t, k]}(x[t]) (+ Shared(x[t])) for every token t.

    x: [T, H] bf16 (fp16/fp32 also accepted); w13: [E, 2I, H], gate rows then up rows (not
    interleaved); w2: [E, H, I]; weights: [T, K] fp32 (already scaled by the routing factor);
    ids: [T, K] int, global expert ids; this call owns experts [first_expert, first_expert + E),
    other ids are skipped (experts split across ranks).
    FP8: w13/w2 float8_e4m3fn with w13_scale [E, 2I] and w2_scale [E, H] fp32 (one scale per
    output row); activations are quantised per row on the fly.
    shared: (w13_s [2I_s, H], w2_s [H, I_s]) (+ (w13_s_scale [2I_s], w2_s_scale [H]) for FP8),
    run as an extra expert with weight 1.0.
    out: optional [T, H] result tensor of any float dtype (an fp32 one receives the unrounded sum;
    being the atomic target itself, it is cleared while x is still read, so it must not alias x).
    reduce: "atomic" (routing weight times the fp32 down GEMM, atomically added into [T, H]) or
    "sum" (each expert's output rounded to x's dtype into [T, K(+1), H], then one pass sums
    them with the routing weights in fp32, in choice order: the reference's rounding points,
    and the same result whatever the atomic order); None takes the tile config's choice
    (`get_config`: "sum" for the prefill tiles where it measured faster, "atomic" for decode,
    where the extra pass would cost a launch per layer).
    extra: with reduce="sum", an optional [T, H] addend (an expert computed elsewhere).
    config: a `get_config`-style dict overriding the tile choice for both GEMMs, or a pair of
    them (gate_up, down; both with the same BLOCK_M) (benchmarks).
    alignment: `moe_route_align`'s (sorted_ids, expert_ids_per_block, num_tokens_post_pad,
    block_m) for these ids, first_expert and shared expert; used when block_m is the tiles'
    BLOCK_M, else the pairs are aligned here.
    x_quant: with FP8 weights, x's per-token FP8 form (e4m3 [T, H], fp32 scale [T]) as
    `quant_rows_fp8(x)` makes it, when the caller has it already (`kernels/rmsnorm.py`
    `fused_add_rms_norm_fp8`); ignored otherwise.
    packed: "mxfp8" | "mxfp4" | "nvfp4": w13 / w2 are codes ([E, 2I, H / per_byte], [E, H,
    I / per_byte]) and w13_scale / w2_scale their block scales ([E, 2I, H / B], [E, H, I / B]),
    NVFP4 with w13_global [E, 2I] / w2_global [E, H] (`global_divides`: compressed-tensors
    divides by them, ModelOpt multiplies); shared is then (w13, w2, w13_scale, w2_scale[,
    w13_global, w2_global]) in the same format. Weights are dequantised in registers and
    multiplied with x as it is (weight-only); the tiles are the bf16 ones (`get_config`).
    Returns out, or a new [T, H] tensor in x's dtype.
    """
    if packed is None:
        _check_inputs(x, w13, w2, weights, ids, w13_scale, w2_scale, shared)
    else:
        _check_packed(x, w13, w2, w13_scale, w2_scale, (w13_global, w2_global), shared, packed)
        if weights.shape != ids.shape or weights.dim() != 2 or ids.shape[0] != x.shape[0]:
            raise ValueError(f"weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must "
                             f"both be [T={x.shape[0]}, K]")
    if reduce not in (None, "atomic", "sum"):
        raise ValueError(f"reduce={reduce!r} must be 'atomic', 'sum' or None")
    if extra is not None and (reduce == "atomic" or extra.shape != x.shape or extra.stride(-1) != 1):
        raise ValueError(f"extra {tuple(extra.shape)} needs reduce='sum', x's shape "
                         f"{tuple(x.shape)} and contiguous rows")
    num_tokens, hidden = x.shape
    num_experts, two_inter = w13.shape[:2]
    inter = two_inter // 2
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    elif out.shape != (num_tokens, hidden):
        raise ValueError(f"out {tuple(out.shape)} must be [T={num_tokens}, H={hidden}]")
    if num_tokens == 0:
        return out
    pack = PACK_CODES[packed] if packed else 0
    fp8 = not pack and w13.dtype == torch.float8_e4m3fn
    tile_dtype = torch.bfloat16 if pack else w13.dtype    # packed: dequantised weights' tiles

    route_w = weights.float().contiguous()                                  # [T, K]
    top_k = ids.shape[1]
    inter_shared = inter
    if shared is not None:
        ws13, ws2 = shared[0].contiguous(), shared[1].contiguous()
        inter_shared = ws13.shape[0] // 2
    else:
        ws13, ws2 = w13, w2
    num_choices = top_k + int(shared is not None)
    num_rows = num_tokens * num_choices
    inter_max = max(inter, inter_shared)

    m_avg = triton.cdiv(num_tokens * top_k, num_experts)
    if isinstance(config, tuple):
        cfg1, cfg2 = map(dict, config)
    else:
        cfg1 = dict(config) if config else get_config(m_avg, inter_max, hidden, tile_dtype, True,
                                                      packed=bool(pack))
        cfg2 = dict(config) if config else get_config(m_avg, hidden, inter_max, tile_dtype,
                                                      packed=bool(pack))
    if pack:   # whole scale blocks per K step, FP4 half-steps of at least 16 for tl.dot
        for cfg in (cfg1, cfg2):
            cfg["BLOCK_K"], cfg["TMA"] = max(32, cfg["BLOCK_K"]), False
    block_m = cfg1["BLOCK_M"]
    if reduce is None:
        reduce = "sum" if cfg1.get("SUM") or extra is not None else "atomic"
    # tensor-descriptor loads need rows of 16-byte multiples (TMA's stride rule)
    h_size = 1 if fp8 else x.element_size()   # the down GEMM reads h (re-quantised for FP8)
    rows_ok = (hidden * w13.element_size() % 16 == 0 and inter_max * h_size % 16 == 0
               and inter * w2.element_size() % 16 == 0 and inter_shared * w2.element_size() % 16 == 0)
    tma = (cfg1.get("TMA") or cfg2.get("TMA")) and rows_ok and not pack and tma_ready(x.device)
    tma1, tma2 = bool(tma and cfg1.get("TMA")), bool(tma and cfg2.get("TMA"))
    if cfg2["BLOCK_M"] != block_m:
        raise ValueError(f"both GEMMs share one alignment: BLOCK_M {block_m} and {cfg2['BLOCK_M']}")
    if alignment is not None and alignment[3] == block_m:
        sorted_ids, block_expert, num_post = alignment[:3]
    else:
        sorted_ids, block_expert, num_post = moe_align(ids, num_experts, block_m,
                                                       first_expert=first_expert,
                                                       shared_expert=shared is not None)
    num_blocks = block_expert.shape[0]
    num_padded = num_blocks * block_m

    w13, w2 = w13.contiguous(), w2.contiguous()
    x = x.contiguous()
    g13 = g2 = gs13 = gs2 = route_w       # placeholders: read only for NVFP4
    if pack:
        xq, x_scale = x, route_w
        s13, s2 = w13_scale.contiguous(), w2_scale.contiguous()
        ss13 = shared[2].contiguous() if shared is not None else s13
        ss2 = shared[3].contiguous() if shared is not None else s2
        if pack == 3:
            g13, g2 = w13_global.float().contiguous(), w2_global.float().contiguous()
            gs13 = shared[4].float().contiguous() if shared is not None else g13
            gs2 = shared[5].float().contiguous() if shared is not None else g2
    elif fp8:   # x's per-token FP8 form: given (made by the norm before, the same bits) or made here
        xq, x_scale = x_quant if x_quant is not None else quant_rows_fp8(x)  # [T, H], [T]
        s13, s2 = w13_scale.float().contiguous(), w2_scale.float().contiguous()
        ss13 = shared[2].float().contiguous() if shared is not None else s13
        ss2 = shared[3].float().contiguous() if shared is not None else s2
    else:
        xq = x
        x_scale = s13 = s2 = ss13 = ss2 = route_w  # placeholders: never read without FP8

    atomic = reduce == "atomic"
    if atomic:   # an fp32 contiguous `out` is the atomic target itself, cleared by gemm1
        direct = out.dtype == torch.float32 and out.is_contiguous()
        acc = out if direct else torch.empty(num_tokens, hidden, dtype=torch.float32,
                                             device=x.device)
    else:   # rows of other ranks' experts stay unwritten: the sum skips them
        acc = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)      # [T*K', H]

    # [B*BM, I_max]; FP8 re-quantises whole rows, so columns past a narrower expert's width
    # (the shared expert's under TP beside whole routed experts) must be zero, not leftovers
    alloc = torch.zeros if fp8 and inter != inter_shared else torch.empty
    h = alloc(num_padded, inter_max, dtype=x.dtype, device=x.device)
    num_n1 = triton.cdiv(inter_max, cfg1["BLOCK_N"])
    grid1 = num_blocks * num_n1
    pdl = pdl_enabled(x)
    split = cfg1.get("SPLIT_K", 1) if not (fp8 or tma) else 1
    if split == 0:
        split = decode_split(num_tokens, top_k, num_experts, inter_max, cfg1["BLOCK_N"],
                             shared is not None, pack) if pack else 1
    # split K: [SPLIT, B*BM, 2 I_max] fp32 gate / up partial sums, then h from their sum
    parts = (torch.empty(split, num_padded, 2 * inter_max, dtype=torch.float32, device=x.device)
             if split > 1 else route_w)
    zero_chunk = triton.cdiv(triton.cdiv(acc.numel(), grid1), 1024) * 1024 if atomic else 0
    part_stride = num_padded * 2 * inter_max
    _gemm1_swiglu_kernel[(grid1, split)](
        xq, x_scale, w13, s13, ws13, ss13, h, sorted_ids, block_expert, num_post,
        num_blocks, num_n1, num_rows, num_choices, hidden, inter, inter_shared, num_experts,
        xq.stride(0), w13.stride(0), w13.stride(1), ws13.stride(0), s13.stride(0), h.stride(0),
        alpha, limit, acc, acc.numel(), zero_chunk,
        g13, gs13, g13.stride(0), s13.stride(-2) if pack else 0, ss13.stride(-2) if pack else 0,
        parts, part_stride, inter_max,
        BLOCK_M=block_m, BLOCK_N=cfg1["BLOCK_N"], BLOCK_K=cfg1["BLOCK_K"],
        GROUP_M=cfg1["GROUP_M"], EVEN_K=hidden % cfg1["BLOCK_K"] == 0, USE_FP8=fp8,
        UPCAST=_INTERPRET, ZERO=atomic, TMA=tma1, PACK=pack, GDIV=bool(global_divides),
        SPLIT=split, PDL=pdl, num_warps=cfg1["num_warps"], num_stages=cfg1["num_stages"],
        **launch_options(pdl))

    if split > 1:
        block_c = min(128, triton.next_power_of_2(inter_max))
        _split_swiglu_kernel[(triton.cdiv(num_padded, 16), triton.cdiv(inter_max, block_c))](
            parts, h, num_post, num_padded, inter_max, part_stride, h.stride(0), alpha, limit,
            SPLIT=split, BLOCK_R=16, BLOCK_C=block_c, PDL=pdl, num_warps=4, **launch_options(pdl))
    if fp8:
        hq, h_scale = quant_rows_fp8(h)                                     # [B*BM, I_max], [B*BM]
    else:
        hq, h_scale = h, route_w
    num_n2 = triton.cdiv(hidden, cfg2["BLOCK_N"])
    _gemm2_kernel[(num_blocks * num_n2,)](
        hq, h_scale, w2, s2, ws2, ss2, acc, route_w, sorted_ids, block_expert, num_post,
        num_blocks, num_n2, num_rows, num_choices, top_k, hidden, inter, inter_shared,
        num_experts,
        hq.stride(0), w2.stride(0), w2.stride(1), ws2.stride(0), s2.stride(0), acc.stride(0),
        g2, gs2, g2.stride(0), s2.stride(-2) if pack else 0, ss2.stride(-2) if pack else 0,
        BLOCK_M=block_m, BLOCK_N=cfg2["BLOCK_N"], BLOCK_K=cfg2["BLOCK_K"],
        GROUP_M=cfg2["GROUP_M"],
        EVEN_K=inter % cfg2["BLOCK_K"] == 0 and inter_shared % cfg2["BLOCK_K"] == 0,
        USE_FP8=fp8, UPCAST=_INTERPRET, ATOMIC=atomic, TMA=tma2, PACK=pack,
        GDIV=bool(global_divides), PDL=pdl, num_warps=cfg2["num_warps"], num_stages=cfg2["num_stages"],
        **launch_options(pdl))
    if not atomic:
        block_h = min(2048, triton.next_power_of_2(hidden))
        ex = extra if extra is not None else acc
        dest = out if out.stride(-1) == 1 else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
            acc, route_w, ids.contiguous(), ex, dest, num_tokens, hidden, top_k, num_choices,
            first_expert, num_experts, acc.stride(0), ex.stride(0), dest.stride(0),
            BLOCK_H=block_h, HAS_SHARED=shared is not None, HAS_EXTRA=extra is not None,
            num_warps=4)
        if dest is not out:
            out.copy_(dest)
    elif acc is not out:
        out.copy_(acc)
    return out
