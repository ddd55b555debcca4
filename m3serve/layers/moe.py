"""MoE block: fp32 sigmoid router with selection-only correction bias, routed experts and the
always-on shared expert.

Parallel layout: the routed experts span the MoE group (all DP x TP ranks): with expert
parallelism each rank owns whole experts, otherwise each rank owns a slice of every expert's
intermediate dimension. The shared expert is split over the TP group like a dense MLP. With one
DP replica the partial sums of both meet in one TP all-reduce; with several, the replicas'
tokens are all-gathered over the DP group first and the routed partials reduce-scattered back
(every replica pads its tokens to the same count, `dp_padded_tokens`).

`route` and `experts_ref` are the PyTorch reference ops (the CPU backend and the oracle for the
fused GPU kernel).
"""
from __future__ import annotations

import torch
from torch import nn

from m3serve.distributed import GroupInfo, ParallelInfo
from m3serve.layers import probes
from m3serve.layers.activation import sigmoid_batch_invariant, swiglu_oai
from m3serve.layers.dispatch import use_triton
from m3serve.layers.linear import (MergedColumnParallelLinear, RowParallelLinear, attach_loader,
                                   check_shape, linear, make_param, replicated_loader)
from m3serve.layers.packed import dequantized, dequantized_scratch, is_row_scale, packed_format, row_fill


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H] -> (weights [T, K] fp32 incl. the routed scaling factor, expert ids [T, K]).
    On CPU the sigmoid runs in fp64 and rounds once (`sigmoid_batch_invariant`), so a row's
    weights do not depend on the rows beside it (the CPU path is batch-invariant, like `linear`)."""
    scores = sigmoid_batch_invariant(linear(x.float(), gate_weight.float()))  # [T, E]
    ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices          # [T, K]
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True) * scale, ids


def experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, first_expert: int, alpha: float, limit: float) -> torch.Tensor:
    """Weighted sum over the selected experts this rank owns.

    x: [T, H]; w13: [E_local, 2I, H] (gate rows then up rows); w2: [E_local, H, I] (tensors, or
    `ExpertWeights` views that dequantise packed experts one at a time); weights/ids: [T, K].
    Returns fp32 [T, H] (partial over ranks).
    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    local = ids - first_expert
    for e in torch.unique(local).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        h = linear(swiglu_oai(linear(x[tok], w13[e]), alpha, limit), w2[e])  # [n, H]
        out.index_add_(0, tok, h.float() * weights[tok, slot, None])
    return out


class ExpertWeights:
    """One packed expert stack seen as dense weights: `[e]` dequantises expert e alone (to the
    activation dtype), so the reference path never holds a whole stack dequantised."""

    def __init__(self, experts: nn.Module, attr: str, dtype: torch.dtype):
        self.experts, self.attr, self.dtype = experts, attr, dtype
        self.shape = getattr(experts, attr).shape[:1]

    def __getitem__(self, e: int) -> torch.Tensor:
        return dequantized(self.experts, self.attr, self.dtype, index=e)


def _expert_layout(cfg, parallel: ParallelInfo) -> ParallelInfo:
    """The layout the routed experts are cut by: the engine's, or the one rank of expert
    parallelism a `expert_view` model stands for (no group: nothing is exchanged)."""
    if cfg.expert_view is None:
        return parallel
    if parallel.moe_size > 1:
        raise ValueError(f"this checkpoint is one rank's view of expert parallelism over "
                         f"{cfg.expert_view[1]} ranks (expert_parallel_view): serve it on one GPU, "
                         f"without tensor, data or expert parallelism")
    rank, size = cfg.expert_view
    return ParallelInfo(tp=GroupInfo(rank, size), enable_expert_parallel=True)


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = attach_loader(make_param((num_experts, hidden), torch.float32),
                                    replicated_loader, [None])
        self.e_score_correction_bias = attach_loader(make_param((num_experts,), torch.float32),
                                                     replicated_loader, [None])


class Experts(nn.Module):
    """This rank's routed experts, stacked: w13 [E_local, 2 I_local, H] (gate rows then up
    rows), w2 [E_local, H, I_local].

    Expert parallelism: E_local = E / moe_size whole experts from `first`. Otherwise all E
    experts, I_local = I / moe_size of each one's intermediate channels from `inter_start`.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, parallel: ParallelInfo, dtype):
        super().__init__()
        n, r = parallel.moe_size, parallel.moe_rank
        self.hidden, self.inter = hidden, inter
        if parallel.enable_expert_parallel:
            if num_experts % n:
                raise ValueError(f"expert parallelism over {n} ranks needs num_local_experts="
                                 f"{num_experts} divisible by {n}")
            self.num_local, self.first = num_experts // n, r * (num_experts // n)
            self.inter_local, self.inter_start = inter, 0
        else:
            if inter % n:
                raise ValueError(f"intermediate_size={inter} (the routed experts' width) is not divisible "
                                 f"by the {n} ranks the MoE layers are split over (tensor x data "
                                 f"parallel); use --enable-expert-parallel or another layout")
            self.num_local, self.first = num_experts, 0
            self.inter_local, self.inter_start = inter // n, r * (inter // n)
        shards = [(kind, e) for e in range(self.first, self.first + self.num_local)
                  for kind in ("w1", "w2", "w3")]
        il = self.inter_local
        self.w13 = attach_loader(make_param((self.num_local, 2 * il, hidden), dtype, True),
                                 self._load, [s for s in shards if s[0] != "w2"])
        self.w2 = attach_loader(make_param((self.num_local, hidden, il), dtype, True),
                                self._load, [s for s in shards if s[0] == "w2"])

    def owns(self, expert_id: int) -> bool:
        return self.first <= expert_id < self.first + self.num_local

    def _load(self, param, full: torch.Tensor, shard_id: tuple[str, int]) -> None:
        kind, e = shard_id
        i, il = e - self.first, self.inter_local
        if is_row_scale(param):
            value = row_fill(param, full, f"expert {e} {kind}")
            if kind == "w2":
                param.data[i] = value
            else:
                param.data[i, slice(0, il) if kind == "w1" else slice(il, 2 * il)] = value
            return
        if kind == "w2":              # this rank's K columns: of the weight, its codes or its scales
            k_div = getattr(param, "k_div", 1)
            check_shape(full, (self.hidden, self.inter // k_div), f"expert {e} w2")
            start = self.inter_start // k_div
            param.data[i].copy_(full[:, start:start + param.shape[-1]])
        else:
            check_shape(full, (self.inter, param.shape[-1]), f"expert {e} {kind}")
            rows = slice(0, il) if kind == "w1" else slice(il, 2 * il)
            param.data[i, rows].copy_(full[self.inter_start:self.inter_start + il])


class DenseMLP(nn.Module):
    """gate_up (column-parallel, gate rows first) -> SwiGLU-OAI -> down (row-parallel)."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float, tp: GroupInfo, dtype,
                 reduce_results: bool = True):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], tp, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, tp, dtype, reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai(self.gate_up_proj(x), self.alpha, self.limit))


class MoE(nn.Module):
    def __init__(self, cfg, parallel: ParallelInfo, dtype, layer_id: int):
        super().__init__()
        self.cfg, self.tp, self.dp = cfg, parallel.tp, parallel.dp
        self.layer_id = layer_id          # the id its routed experts are reported under (layers/probes.py)
        self.gate = Router(cfg.hidden_size, cfg.num_local_experts)
        self.experts = Experts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size,
                               _expert_layout(cfg, parallel), dtype)
        self.shared_experts = DenseMLP(cfg.hidden_size, cfg.shared_intermediate_size, cfg.swiglu_alpha,
                                       cfg.swiglu_limit, parallel.tp, dtype, reduce_results=False)

    def forward(self, x: torch.Tensor, dp_padded_tokens: int = 0, keep_fp32: bool = False,
                x_quant: tuple | None = None) -> torch.Tensor:
        """x: [T, H] -> [T, H] in x's dtype, or with `keep_fp32` the fp32 sum before that cast.
        With several DP replicas every one passes the same `dp_padded_tokens` >= its T (the
        largest T among them). `x_quant`: x's per-token FP8 form where `takes_fp8_input(x)`
        (made by the norm before it)."""
        exchange = self.dp.active
        tokens = x
        if exchange:
            if dp_padded_tokens < x.shape[0]:
                raise RuntimeError(f"MoE over {self.dp.size} DP replicas needs dp_padded_tokens >= "
                                   f"{x.shape[0]}, got {dp_padded_tokens}")
            pad = dp_padded_tokens - x.shape[0]
            tokens = self.dp.all_gather(torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x)
        out = self._routed(tokens, fold_shared=not exchange,
                           x_quant=None if exchange else x_quant)            # fp32 [N, H]
        if exchange:
            out = self.dp.reduce_scatter(out)[:x.shape[0]] + self.shared_experts(x).float()
        out = self.tp.all_reduce(out)
        return out if keep_fp32 else out.to(x.dtype)

    def tile_token_counts(self, max_tokens: int) -> list[int]:
        """Step sizes up to max_tokens that reach every tile variant of the fused kernels (the
        start-up warm-up's forwards)."""
        from m3serve.kernels.fused_moe import PACK_CODES, regime_token_counts, split_token_counts
        gathered = self.dp.size if self.dp.active else 1   # DP replicas' tokens meet here
        top_k, ex = self.cfg.num_experts_per_tok * gathered, self.experts
        counts = regime_token_counts(ex.num_local, top_k, max_tokens, self.tile_dtype)
        fmt = packed_format(ex, "w13")
        if fmt is not None:
            # a step from DEQUANT_MOE_MIN_TOKENS on may run the 16-bit kernels from a dequantised
            # scratch, one below it the packed kernels: each regime also at its largest size
            # below that bound (else a mixed step of 1,281-2,047 tokens at one TP 8 rank
            # compiles the packed kernels' largest tiles while serving)
            counts += [min(c, DEQUANT_MOE_MIN_TOKENS - 1) for c in counts]
            # and each split K of decode steps
            shared = self._shared_in_kernel()
            inter = max(ex.inter_local, self.cfg.shared_intermediate_size // self.tp.size if shared else 0)
            counts += split_token_counts(ex.num_local, top_k, inter, shared, PACK_CODES[fmt.kind],
                                         max_tokens)
        return sorted(set(counts))

    @property
    def tile_dtype(self) -> torch.dtype:
        """The weight dtype whose tiles the fused kernels take: packed experts are dequantised
        to bf16 tiles in registers."""
        return torch.bfloat16 if packed_format(self.experts, "w13") else self.experts.w13.dtype

    def _shared_in_kernel(self) -> bool:
        """Whether the shared expert can run inside the fused kernels as one more expert: its
        two weights held like the routed experts' (the same packed format, or both unpacked
        with FP8 scales exactly when the experts have them)."""
        ex, sh = self.experts, self.shared_experts
        fmt = packed_format(ex, "w13")
        if fmt is not None:
            return all(packed_format(m, "weight") == fmt for m in (sh.gate_up_proj, sh.down_proj))
        if any(packed_format(m, "weight") for m in (sh.gate_up_proj, sh.down_proj)):
            return False
        return all(hasattr(m, "weight_scale") == hasattr(ex, "w13_scale")
                   for m in (sh.gate_up_proj, sh.down_proj))

    @property
    def is_packed(self) -> bool:
        """Any of the routed or shared experts' weights held as packed codes."""
        return any(m.__dict__.get("packed") for m in (self.experts, self.shared_experts.gate_up_proj,
                                                        self.shared_experts.down_proj))

    def takes_fp8_input(self, x: torch.Tensor) -> bool:
        """Whether this step's fused experts read x's per-token FP8 form (FP8 expert weights on
        the Triton path, one DP replica): the norm before can then make it (`forward`'s x_quant)."""
        return (not self.dp.active and self.experts.w13.dtype == torch.float8_e4m3fn
                and packed_format(self.experts, "w13") is None and use_triton("moe", x))

    def _routed(self, x: torch.Tensor, fold_shared: bool, x_quant: tuple | None = None) -> torch.Tensor:
        """Routed experts (+ the shared expert when `fold_shared`) over x [N, H] -> fp32 [N, H],
        this rank's partial sum."""
        cfg = self.cfg
        if use_triton("moe", x):
            from m3serve.kernels import fused_moe as fm
            gate, bias, top_k = self.gate.weight, self.gate.e_score_correction_bias, cfg.num_experts_per_tok
            in_kernel = fold_shared and self._shared_in_kernel()
            alignment = None
            if (x.shape[0] <= fm.ROUTE_ALIGN_MAX_TOKENS       # decode rows: one launch for all three
                    and fm.route_align_eligible(x, gate.shape[0], top_k)):
                ex = self.experts
                block_m = fm.decode_block_m(x.shape[0], top_k, ex.num_local, self.tile_dtype)
                weights, ids, alignment = fm.moe_route_align(
                    x, gate, bias, top_k, cfg.routed_scaling_factor, ex.num_local, block_m,
                    first_expert=ex.first, shared_expert=in_kernel)
            else:
                weights, ids = fm.moe_route(x, gate, bias, top_k, cfg.routed_scaling_factor)
            out = self._fused(fm.fused_moe, x, weights, ids, in_kernel, alignment, x_quant)
            if fold_shared and not in_kernel:
                out += self.shared_experts(x).float()
            return out
        if self.is_packed:
            return self._routed_packed(x, fold_shared)
        weights, ids = route(x, self.gate.weight, self.gate.e_score_correction_bias,
                             cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        if hasattr(self.experts, "w13_scale"):      # FP8 experts: the fused kernel's PyTorch twin
            from m3serve.kernels.ref.fused_moe import fused_moe_ref
            return self._fused(fused_moe_ref, x, weights, ids, fold_shared)
        if probes.active is not None:
            probes.active.record(probes.ROUTED_EXPERTS, self.layer_id, ids)
        out = experts_ref(x, self.experts.w13, self.experts.w2, weights, ids, self.experts.first,
                          cfg.swiglu_alpha, cfg.swiglu_limit)
        return out + self.shared_experts(x).float() if fold_shared else out

    def _routed_packed(self, x: torch.Tensor, fold_shared: bool) -> torch.Tensor:
        """The reference path for packed experts: each selected expert dequantised, then
        multiplied (the oracle a packed fused-MoE kernel will be checked against)."""
        from m3serve.layers.dispatch import executed
        cfg, ex = self.cfg, self.experts
        executed[("packed_moe", "reference")] += 1
        weights, ids = route(x, self.gate.weight, self.gate.e_score_correction_bias,
                             cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        if probes.active is not None:
            probes.active.record(probes.ROUTED_EXPERTS, self.layer_id, ids)
        w13 = ExpertWeights(ex, "w13", x.dtype) if packed_format(ex, "w13") else ex.w13
        w2 = ExpertWeights(ex, "w2", x.dtype) if packed_format(ex, "w2") else ex.w2
        out = experts_ref(x, w13, w2, weights, ids, ex.first, cfg.swiglu_alpha, cfg.swiglu_limit)
        return out + self.shared_experts(x).float() if fold_shared else out

    def _dequantise_for(self, x: torch.Tensor) -> bool:
        """Whether this step's packed experts run from a dequantised 16-bit scratch: a prefill
        step of at least DEQUANT_MOE_MIN_TOKENS tokens with 16-bit activations, and a scratch of
        at most DEQUANT_MOE_MAX_BYTES (this rank's experts; counted by the start-up memory
        profile like any activation)."""
        if x.shape[0] < DEQUANT_MOE_MIN_TOKENS or x.dtype not in (torch.bfloat16, torch.float16):
            return False
        ex = self.experts
        return ex.num_local * 3 * ex.inter_local * self.cfg.hidden_size * x.element_size() <= DEQUANT_MOE_MAX_BYTES

    def _fused(self, moe_fn, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               fold_shared: bool, alignment: tuple | None = None,
               x_quant: tuple | None = None) -> torch.Tensor:
        """Routed experts (+ the shared expert) in one fused call (bf16, FP8 or packed weights);
        `alignment`: `moe_route_align`'s, for the Triton kernel; `x_quant`: x's FP8 form."""
        cfg, ex, sh = self.cfg, self.experts, self.shared_experts
        if probes.active is not None:
            probes.active.record(probes.ROUTED_EXPERTS, self.layer_id, ids)
        scales = {}
        fmt = packed_format(ex, "w13")
        if fmt is not None:
            scales = dict(packed=fmt.kind, global_divides=fmt.global_divides,
                          w13_scale=ex.w13_block_scale, w2_scale=ex.w2_block_scale)
            if fmt.has_global:
                scales.update(w13_global=ex.w13_global_scale, w2_global=ex.w2_global_scale)
        elif hasattr(ex, "w13_scale"):
            scales = dict(w13_scale=ex.w13_scale, w2_scale=ex.w2_scale)
        shared = None
        if fold_shared:
            up, down = sh.gate_up_proj, sh.down_proj
            shared = (up.weight, down.weight)
            if fmt is not None:
                shared += (up.weight_block_scale, down.weight_block_scale)
                if fmt.has_global:
                    shared += (up.weight_global_scale, down.weight_global_scale)
            elif scales:
                shared += (up.weight_scale, down.weight_scale)
        w13, w2 = ex.w13, ex.w2
        if fmt is not None and self._dequantise_for(x):
            # a long prefill step: every expert dequantised once into a 16-bit scratch, then
            # the 16-bit kernels (the same products, faster tiles than in-register decoding)
            w13, w2 = dequantized_scratch(ex, "w13", x.dtype), dequantized_scratch(ex, "w2", x.dtype)
            if shared is not None:
                shared = (dequantized_scratch(sh.gate_up_proj, "weight", x.dtype),
                          dequantized_scratch(sh.down_proj, "weight", x.dtype))
            scales = {}
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        moe_fn(x, w13, w2, weights, ids, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
               shared=shared, out=out, first_expert=ex.first,
               **scales, **({"alignment": alignment} if alignment is not None else {}),
               **({"x_quant": x_quant} if x_quant is not None else {}))
        return out


# A prefill step of this many tokens or more multiplies packed experts from a dequantised 16-bit
# scratch (when this rank's experts fit in DEQUANT_MOE_MAX_BYTES): dequantising every expert
# once costs about one read of the codes and one write of the scratch, less than the in-register
# decoding costs over that many tokens (docs/performance.md).
DEQUANT_MOE_MIN_TOKENS = 2048
DEQUANT_MOE_MAX_BYTES = 2 << 30
