"""MoE block: fp32 sigmoid router with selection-only correction bias, routed experts (split by
expert index across TP ranks) and the always-on shared expert; one all-reduce for both.

`route` and `experts_ref` are the PyTorch reference ops (the CPU backend and the oracle for the
fused GPU kernel).
"""
from __future__ import annotations

import torch
from torch import nn

from m3serve.distributed import TPInfo
from m3serve.layers.activation import swiglu_oai
from m3serve.layers.dispatch import use_triton
from m3serve.layers.linear import (MergedColumnParallelLinear, RowParallelLinear, attach_loader,
                                   check_shape, linear, make_param, replicated_loader)


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H] -> (weights [T, K] fp32 incl. the routed scaling factor, expert ids [T, K])."""
    scores = torch.sigmoid(linear(x.float(), gate_weight.float()))         # [T, E]
    ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices          # [T, K]
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True) * scale, ids


def experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, first_expert: int, alpha: float, limit: float) -> torch.Tensor:
    """Weighted sum over the selected experts this rank owns.

    x: [T, H]; w13: [E_local, 2I, H] (gate rows then up rows); w2: [E_local, H, I];
    weights/ids: [T, K]. Returns fp32 [T, H] (partial over ranks).
    """
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    local = ids - first_expert
    for e in torch.unique(local).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        h = linear(swiglu_oai(linear(x[tok], w13[e]), alpha, limit), w2[e])  # [n, H]
        out.index_add_(0, tok, h.float() * weights[tok, slot, None])
    return out


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = attach_loader(make_param((num_experts, hidden), torch.float32),
                                    replicated_loader, [None])
        self.e_score_correction_bias = attach_loader(make_param((num_experts,), torch.float32),
                                                     replicated_loader, [None])


class Experts(nn.Module):
    """This rank's routed experts, stacked: w13 [E_local, 2I, H], w2 [E_local, H, I]."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp: TPInfo, dtype):
        super().__init__()
        if num_experts % tp.size:
            raise ValueError(f"num_local_experts={num_experts} not divisible by TP={tp.size}")
        self.num_local = num_experts // tp.size
        self.first = tp.rank * self.num_local
        self.hidden, self.inter = hidden, inter
        shards = [(kind, e) for e in range(self.first, self.first + self.num_local)
                  for kind in ("w1", "w2", "w3")]
        self.w13 = attach_loader(make_param((self.num_local, 2 * inter, hidden), dtype),
                                 self._load, [s for s in shards if s[0] != "w2"])
        self.w2 = attach_loader(make_param((self.num_local, hidden, inter), dtype),
                                self._load, [s for s in shards if s[0] == "w2"])

    def owns(self, expert_id: int) -> bool:
        return self.first <= expert_id < self.first + self.num_local

    def _load(self, param, full: torch.Tensor, shard_id: tuple[str, int]) -> None:
        kind, e = shard_id
        i = e - self.first
        if kind == "w2":
            check_shape(full, (self.hidden, self.inter), f"expert {e} w2")
            param.data[i].copy_(full)
        else:
            check_shape(full, (self.inter, self.hidden), f"expert {e} {kind}")
            rows = slice(0, self.inter) if kind == "w1" else slice(self.inter, 2 * self.inter)
            param.data[i, rows].copy_(full)


class DenseMLP(nn.Module):
    """gate_up (column-parallel, gate rows first) -> SwiGLU-OAI -> down (row-parallel)."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float, tp: TPInfo, dtype,
                 reduce_results: bool = True):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], tp, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, tp, dtype, reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai(self.gate_up_proj(x), self.alpha, self.limit))


class MoE(nn.Module):
    def __init__(self, cfg, tp: TPInfo, dtype):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.gate = Router(cfg.hidden_size, cfg.num_local_experts)
        self.experts = Experts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, tp, dtype)
        self.shared_experts = DenseMLP(cfg.hidden_size, cfg.shared_intermediate_size, cfg.swiglu_alpha,
                                       cfg.swiglu_limit, tp, dtype, reduce_results=False)
        self.last_expert_ids: torch.Tensor | None = None  # [T, K], kept for tests and benchmarks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        cfg = self.cfg
        if use_triton("moe", x):
            from m3serve.kernels.fused_moe import fused_moe, moe_route
            weights, ids = moe_route(x, self.gate.weight, self.gate.e_score_correction_bias,
                                     cfg.num_experts_per_tok, cfg.routed_scaling_factor)
            return self._fused(fused_moe, x, weights, ids)
        weights, ids = route(x, self.gate.weight, self.gate.e_score_correction_bias,
                             cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        if hasattr(self.experts, "w13_scale"):      # FP8 experts: the fused kernel's PyTorch twin
            from m3serve.kernels.ref.fused_moe import fused_moe_ref
            return self._fused(fused_moe_ref, x, weights, ids)
        self.last_expert_ids = ids
        routed = experts_ref(x, self.experts.w13, self.experts.w2, weights, ids, self.experts.first,
                             cfg.swiglu_alpha, cfg.swiglu_limit)
        out = routed + self.shared_experts(x).float()
        return self.tp.all_reduce(out).to(x.dtype)

    def _fused(self, moe_fn, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routed experts + shared expert in one fused call (bf16 or FP8 weights)."""
        cfg, ex, sh = self.cfg, self.experts, self.shared_experts
        self.last_expert_ids = ids
        shared = (sh.gate_up_proj.weight, sh.down_proj.weight)
        scales = {}
        if hasattr(ex, "w13_scale"):
            scales = dict(w13_scale=ex.w13_scale, w2_scale=ex.w2_scale)
            shared += (sh.gate_up_proj.weight_scale, sh.down_proj.weight_scale)
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        moe_fn(x, ex.w13, ex.w2, weights, ids, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
               shared=shared, out=out, first_expert=ex.first, **scales)
        return self.tp.all_reduce(out).to(x.dtype)
