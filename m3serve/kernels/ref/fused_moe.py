"""PyTorch twins of the fused-MoE kernels (the CPU backend and the oracle for the Triton path):
routing, per-row FP8 quantisation, per-channel FP8 weight quantisation and `fused_moe_ref`,
which follows the kernel's rounding points (fp32 GEMMs, h in x's dtype, fp32 weighted sum).
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0          # largest finite float8_e4m3fn
# Floor of a per-token activation scale, so an all-zero row quantises to zeros instead of NaN.
FP8_MIN_SCALE = 1e-12
# Floor of a weight row's scale (docs/model.md §8.3), so an all-zero row stays finite.
FP8_MIN_WEIGHT_SCALE = 1.0 / (FP8_MAX * 512)



def moe_route_ref(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                  routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `moe_route` (same contract): sigmoid scores in fp32, top-k of the biased
    scores, the chosen scores renormalised and scaled."""
    scores = torch.sigmoid(x.float() @ gate_weight.float().t())           # [T, E]
    ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices         # [T, K]
    weights = scores.gather(1, ids)                                         # [T, K]
    weights = weights / weights.sum(-1, keepdim=True) * routed_scaling_factor
    return weights, ids.to(torch.int32)


def max_aligned_blocks(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Upper bound on the blocks `moe_align` can produce for num_pairs (token, choice) pairs.

    Each non-empty slot wastes less than one block, and at most min(slots, pairs) are non-empty.
    """
    return -(-num_pairs // block_m) + min(num_slots, num_pairs)


def moe_align_ref(ids: torch.Tensor, num_experts: int, block_m: int, *, first_expert: int = 0,
                  shared_expert: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of `moe_align` (same contract), with a stable order inside each expert's run."""
    device = ids.device
    num_tokens, _top_k = ids.shape
    slots = ids.long() - first_expert                                       # [T, K]
    slots = torch.where((slots >= 0) & (slots < num_experts), slots, -1)
    if shared_expert:
        extra = torch.full((num_tokens, 1), num_experts, dtype=torch.int64, device=device)
        slots = torch.cat([slots, extra], dim=1)                            # [T, K + 1]
    num_slots = num_experts + int(shared_expert)
    flat = slots.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = max_aligned_blocks(num_pairs, num_slots, block_m)
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    block_expert = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
    pos = 0
    for e in range(num_slots):
        members = torch.nonzero(flat == e).flatten()
        if members.numel() == 0:
            continue
        sorted_ids[pos:pos + members.numel()] = members.to(torch.int32)
        padded = -(-members.numel() // block_m) * block_m
        block_expert[pos // block_m:(pos + padded) // block_m] = e
        pos += padded
    return sorted_ids, block_expert, torch.tensor([pos], dtype=torch.int32, device=device)


def quant_rows_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic FP8: x [R, C] -> (e4m3 [R, C], scale [R] fp32), x ~= q * scale."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)    # [R]
    q = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quant_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 of a weight [..., O, I] -> (e4m3 [..., O, I], scale [..., O] fp32)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1) / FP8_MAX).clamp(min=FP8_MIN_WEIGHT_SCALE)
    q = (wf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _swiglu_fp32(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1.0)


def _expert(xe, x_scale, w13, s13, w2, s2, alpha, limit, act_dtype):
    """One expert on its rows: fp32 GEMMs, activation rounded to act_dtype between them."""
    gate_up = xe.float() @ w13.float().t()                                # [n, 2I]
    if s13 is not None:
        gate_up = gate_up * x_scale[:, None] * s13.float()[None, :]
    h = _swiglu_fp32(gate_up, alpha, limit).to(act_dtype)                  # [n, I]
    if s2 is None:
        return h.float() @ w2.float().t()                                   # [n, H]
    hq, h_scale = quant_rows_fp8_ref(h)
    return (hq.float() @ w2.float().t()) * h_scale[:, None] * s2.float()[None, :]


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,
                  shared: tuple[torch.Tensor, ...] | None = None, out: torch.Tensor | None = None,
                  first_expert: int = 0, reduce: str | None = "atomic", extra: torch.Tensor | None = None,
                  config: dict | None = None, x_quant: tuple | None = None) -> torch.Tensor:
    """Reference of `m3serve.kernels.fused_moe.fused_moe` (same contract and rounding points:
    reduce="sum" rounds each expert's output to x's dtype before the weighted fp32 sum; None
    means "sum" with `extra`, else "atomic" (the kernel's None follows its tile table); config
    and x_quant (x's FP8 form, which the reference makes itself: the same bits) are accepted for
    signature parity and ignored)."""
    if reduce is None:
        reduce = "sum" if extra is not None else "atomic"
    if reduce not in ("atomic", "sum"):
        raise ValueError(f"reduce={reduce!r} must be 'atomic', 'sum' or None")
    if extra is not None and (reduce == "atomic" or extra.shape != x.shape):
        raise ValueError(f"extra {tuple(extra.shape)} needs reduce='sum' and x's shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    num_experts = w13.shape[0]
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8:
        xin, x_scale = quant_rows_fp8_ref(x)
    else:
        xin, x_scale = x, None
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)  # [T, H]
    rounded = (lambda y: y.to(x.dtype).float()) if reduce == "sum" else (lambda y: y)
    local = ids.long() - first_expert
    for e in torch.unique(local).tolist():
        if not 0 <= e < num_experts:
            continue
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        y = _expert(xin[tok], x_scale[tok] if fp8 else None, w13[e],
                    w13_scale[e] if fp8 else None, w2[e], w2_scale[e] if fp8 else None,
                    alpha, limit, x.dtype)
        acc.index_add_(0, tok, rounded(y) * weights[tok, slot, None].float())
    if shared is not None:
        acc += rounded(_expert(xin, x_scale, shared[0], shared[2] if fp8 else None, shared[1],
                               shared[3] if fp8 else None, alpha, limit, x.dtype))
    if extra is not None:
        acc += extra.float()
    if out is None:
        return acc.to(x.dtype)
    return out.copy_(acc)
