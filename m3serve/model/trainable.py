"""A batched, differentiable MiniMax-M3 text model over canonical weights: what trains the
embedded tiny model (`model/train_tiny.py`) and its MTP draft (`distill/mtp.py`).

The math is the dense reference's (`model/reference.py`, whose norm, RoPE and SwiGLU helpers it
calls; `tests/model/test_trainable.py` holds the two equal), over a batch of equal-length
sequences that start at position 0. MSA's block selection is a mask over dense scores. The
top-k gives the indexer no gradient, so it learns from a loss of its own: the KL divergence from
the attention's probability mass per key block (dense, causal, averaged over the query heads of
the KV group the index head serves) to the softmax of its block scores, computed from a detached
input so that it trains the indexer alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from m3serve.model.config import M3Config, canonical_shapes, layer_shapes
from m3serve.model.reference import apply_rope, gemma_rms_norm, rope_cos_sin, swiglu_oai

ROUTER_SUFFIXES = ("block_sparse_moe.gate.weight", "e_score_correction_bias")


def is_router(name: str) -> bool:
    """The MoE router tensors, which checkpoints keep in fp32."""
    return name.endswith(ROUTER_SUFFIXES)


def init_weights(shapes: dict[str, tuple[int, ...]], num_layers: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """fp32 initial values for canonical tensors: norms 0 (Gemma offsets from 1), routing biases
    0, the embedding N(0, 1), other matrices N(0, 1/fan_in), the residual branches' output
    projections scaled down by sqrt(2 * num_layers)."""
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = torch.zeros(shape)
        elif name.endswith("embed_tokens.weight"):
            out[name] = torch.randn(shape, generator=gen)
        else:
            std = shape[-1] ** -0.5
            if name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight")):
                std /= math.sqrt(2 * num_layers)
            out[name] = torch.randn(shape, generator=gen) * std
    return out


@dataclass
class ForwardStats:
    """What one forward collects besides its outputs: the indexers' KL losses (summed over the
    sparse layers) and every MoE layer's expert loads (tokens routed to each expert) by prefix."""
    index_loss: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    expert_load: dict[str, torch.Tensor] = field(default_factory=dict)


def _mlp(w, p: str, cfg: M3Config, x: torch.Tensor) -> torch.Tensor:
    h = swiglu_oai(x @ w[p + "gate_proj.weight"].t(), x @ w[p + "up_proj.weight"].t(),
                   cfg.swiglu_alpha, cfg.swiglu_limit)
    return h @ w[p + "down_proj.weight"].t()


def _moe(w, p: str, cfg: M3Config, x: torch.Tensor, stats: ForwardStats) -> torch.Tensor:
    """x: [N, H] -> [N, H]: sigmoid routing with the correction bias choosing the experts (not
    weighting them), top-k weights renormalised, the routed sum scaled, plus the shared expert."""
    scores = torch.sigmoid(x @ w[p + "gate.weight"].t())                       # [N, E]
    sel = torch.topk(scores.detach() + w[p + "e_score_correction_bias"], cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, sel)
    weights = weights / weights.sum(-1, keepdim=True)                            # [N, K]
    out = torch.zeros_like(x)
    stats.expert_load[p] = torch.bincount(sel.reshape(-1), minlength=cfg.num_local_experts)
    for e in range(cfg.num_local_experts):
        rows, slot = (sel == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        # index_select / index_add, not advanced indexing: their backward sums in a fixed order
        q, xe = f"{p}experts.{e}.", x.index_select(0, rows)
        h = swiglu_oai(xe @ w[q + "w1.weight"].t(), xe @ w[q + "w3.weight"].t(), cfg.swiglu_alpha, cfg.swiglu_limit)
        gate = weights.reshape(-1).index_select(0, rows * cfg.num_experts_per_tok + slot)[:, None]
        out = out.index_add(0, rows, gate * (h @ w[q + "w2.weight"].t()))
    return cfg.routed_scaling_factor * out + _mlp(w, p + "shared_experts.", cfg, x)


def _block_selection(w, p: str, cfg: M3Config, xn: torch.Tensor, cos, sin, causal: torch.Tensor):
    """The indexer over xn [B, S, H] -> (block scores [B, Hi, S, nb] with -inf for blocks past
    the query, selected-key mask [B, Hi, S, S])."""
    B, S, _ = xn.shape
    bs, Hi, Di = cfg.index_block_size, cfg.index_n_heads, cfg.index_head_dim
    nb = S // bs
    iq = (xn @ w[p + "index_q_proj.weight"].t()).view(B * S, Hi, Di)
    ik = (xn @ w[p + "index_k_proj.weight"].t()).view(B * S, 1, Di)
    iq = apply_rope(gemma_rms_norm(iq, w[p + "index_q_norm.weight"], cfg.rms_norm_eps), cos, sin).view(B, S, Hi, Di)
    ik = apply_rope(gemma_rms_norm(ik, w[p + "index_k_norm.weight"], cfg.rms_norm_eps), cos, sin).view(B, S, Di)
    scores = torch.einsum("bshd,btd->bhst", iq, ik).masked_fill(~causal, -math.inf)     # [B, Hi, S, S]
    block_scores = scores.view(B, Hi, S, nb, bs).amax(-1)                                # [B, Hi, S, nb]
    own = torch.arange(S) // bs                                                          # [S]
    blocks = torch.arange(nb)
    forced = ((blocks[None, :] > own[:, None] - cfg.index_local_blocks) & (blocks[None, :] <= own[:, None])) \
        | (blocks[None, :] < cfg.index_init_blocks)                                      # [S, nb]
    choice = block_scores.detach().masked_fill(forced, math.inf)
    top = torch.topk(choice, min(cfg.index_topk_blocks, nb), dim=-1).indices
    chosen = torch.zeros_like(choice, dtype=torch.bool).scatter_(-1, top, True)          # [B, Hi, S, nb]
    return block_scores, chosen.repeat_interleave(bs, dim=-1)


def _index_kl(block_scores: torch.Tensor, dense_probs: torch.Tensor, cfg: M3Config) -> torch.Tensor:
    """KL(attention mass per block || softmax(block scores)), averaged over queries and index
    heads. block_scores [B, Hi, S, nb]; dense_probs [B, H, S, S] (detached)."""
    B, H, S, _ = dense_probs.shape
    Hi, bs = block_scores.shape[1], cfg.index_block_size
    mass = dense_probs.view(B, Hi, H // Hi, S, S // bs, bs).sum(-1).mean(2)          # [B, Hi, S, nb]
    valid = torch.isfinite(block_scores)
    logq = torch.log_softmax(block_scores, dim=-1).masked_fill(~valid, 0.0)
    plogp = torch.where(mass > 0, mass * mass.clamp_min(1e-30).log(), torch.zeros_like(mass))
    return (plogp - mass * logq).sum(-1).mean()


def _attention(w, p: str, cfg: M3Config, xn: torch.Tensor, cos, sin, sparse: bool,
               stats: ForwardStats) -> torch.Tensor:
    """xn [B, S, H] -> attention output projected [B, S, H]."""
    B, S, _ = xn.shape
    D, H, G = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    flat = xn.reshape(B * S, -1)
    q = (flat @ w[p + "q_proj.weight"].t()).view(B * S, H, D)
    k = (flat @ w[p + "k_proj.weight"].t()).view(B * S, G, D)
    v = (flat @ w[p + "v_proj.weight"].t()).view(B, S, G, D)
    q = apply_rope(gemma_rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps), cos, sin).view(B, S, H, D)
    k = apply_rope(gemma_rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps), cos, sin).view(B, S, G, D)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)                # [B, heads, S, D]
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    if not sparse:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        with torch.no_grad():
            dense = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~causal, -math.inf), -1)
        block_scores, chosen = _block_selection(w, p, cfg, xn.detach(), cos, sin, causal)
        stats.index_loss = stats.index_loss + _index_kl(block_scores, dense, cfg)
        mask = (chosen & causal).repeat_interleave(H // G, dim=1)                     # [B, H, S, S]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return o.transpose(1, 2).reshape(B, S, H * D) @ w[p + "o_proj.weight"].t()


def decoder_layer(w, p: str, cfg: M3Config, x: torch.Tensor, cos, sin, sparse: bool, moe: bool,
                  stats: ForwardStats) -> torch.Tensor:
    """One pre-norm decoder layer under prefix `p` (canonical names): x [B, S, H] -> [B, S, H]."""
    B, S, Hd = x.shape
    xn = gemma_rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
    x = x + _attention(w, p + "self_attn.", cfg, xn, cos, sin, sparse, stats)
    xn = gemma_rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps).reshape(B * S, Hd)
    if moe:
        return x + _moe(w, p + "block_sparse_moe.", cfg, xn, stats).view(B, S, Hd)
    return x + _mlp(w, p + "mlp.", cfg, xn).view(B, S, Hd)


@dataclass
class TrainOutput:
    logits: torch.Tensor          # [B, S, V] fp32
    hidden: torch.Tensor          # [B, S, H] after the final norm (what MTP reads)
    streams: torch.Tensor | None  # [B, S, len(taps) * H]: the residual stream entering each tap layer
    stats: ForwardStats


class ParamStore(nn.Module):
    """fp32 parameters addressed by canonical name (`store[name]`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.names = list(tensors)
        self.params = nn.ParameterDict({n.replace(".", "/"): nn.Parameter(t.float().clone())
                                        for n, t in tensors.items()})
        for n in self.names:               # the routing bias moves by its balancing rule, not by gradient
            if n.endswith("e_score_correction_bias"):
                self.params[n.replace(".", "/")].requires_grad_(False)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "/")]

    def export(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Canonical name -> tensor as a checkpoint holds it (routers fp32, the rest `dtype`)."""
        return {n: self[n].detach().to(torch.float32 if is_router(n) else dtype).contiguous() for n in self.names}

    def balance_experts_(self, loads: dict[str, torch.Tensor], rate: float) -> None:
        """Auxiliary-loss-free balancing: each MoE layer's correction bias moves by `rate` towards
        the experts that got fewer than the mean number of tokens."""
        with torch.no_grad():
            for p, load in loads.items():
                bias = self[p + "e_score_correction_bias"]
                bias += rate * torch.sign(load.float().mean() - load.float())


class TrainableM3(nn.Module):
    """The text model of `cfg` with trainable fp32 weights (canonical names)."""

    def __init__(self, cfg: M3Config, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        if cfg.index_topk_freq != 1:
            raise ValueError(f"index_topk_freq {cfg.index_topk_freq}: the training forward runs every sparse "
                             f"layer's own indexer (cross-layer top-k reuse off)")
        missing = set(canonical_shapes(cfg)) - set(weights)
        if missing:
            raise ValueError(f"weights lack {sorted(missing)[:5]} ({len(missing)} tensors)")
        self.w = ParamStore({n: weights[n] for n in canonical_shapes(cfg)})

    def forward(self, ids: torch.Tensor, taps: tuple[int, ...] = ()) -> TrainOutput:
        """ids [B, S] (S a multiple of the index block size) -> `TrainOutput`; `taps` as the
        serving model's: the stream entering layer i, num_hidden_layers = the final norm's input."""
        cfg, w = self.cfg, self.w
        B, S = ids.shape
        if S % cfg.index_block_size:
            raise ValueError(f"sequence length {S} must be a multiple of the index block size {cfg.index_block_size}")
        # F.embedding: its backward, unlike advanced indexing's, sums in the same order on every run
        x = F.embedding(ids, w["model.embed_tokens.weight"])                          # [B, S, H]
        cos, sin = rope_cos_sin(cfg, torch.arange(S).repeat(B), x.dtype)               # [B * S, rotary / 2]
        stats, streams = ForwardStats(), []
        for i in range(cfg.num_hidden_layers):
            streams += [x] * taps.count(i)
            x = decoder_layer(w, f"model.layers.{i}.", cfg, x, cos, sin, cfg.is_sparse(i), cfg.is_moe(i), stats)
        streams += [x] * taps.count(cfg.num_hidden_layers)
        hidden = gemma_rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)
        return TrainOutput(hidden @ w["lm_head.weight"].t(), hidden,
                           torch.cat(streams, dim=-1) if streams else None, stats)


def mtp_layer_shapes(cfg: M3Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """An MTP module's tensors under `prefix` (`model.mtp.layers.{m}.`), canonical layout of its
    decoder layer (MSA + MoE) under `transformer_layer.`."""
    H = cfg.hidden_size
    shapes = {prefix + n: (H,) for n in ("enorm.weight", "hnorm.weight", "final_layernorm.weight")}
    shapes[prefix + "eh_proj.weight"] = (H, 2 * H)
    shapes.update(layer_shapes(cfg, prefix + "transformer_layer.", sparse=True, moe=True))
    return shapes


def read_canonical(model_dir, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint's text tensors in canonical names as fp32 (only `names` when given)."""
    from m3serve.model.checkpoint import canonicalize, iter_checkpoint, materialize, weight_files

    out = {}
    for _, key, t in iter_checkpoint(weight_files(Path(model_dir))):
        for name, tensor in canonicalize(key, t) or []:
            if names is None or name in names:
                out[name] = materialize(tensor).float()
    missing = set(names or ()) - set(out)
    if missing:
        raise ValueError(f"{model_dir}: no tensor {sorted(missing)}")
    return out
