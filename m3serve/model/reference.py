"""The dense single-file MiniMax-M3 oracle: slow, obvious PyTorch, one sequence at a time.

It shares no code with the serving layers on purpose, so that a bug in a fast path cannot hide in
both. Weights come as a dict in canonical checkpoint names (see `model/loader.py`,
`iter_canonical_tensors`). `forward` returns fp32 logits and, per sparse layer, the indexer's
selected block ids (with cross-layer top-k reuse on, a layer that skips its indexer reports the
selection it reused).
"""
from __future__ import annotations

import math

import torch

from m3serve.model.config import M3Config


def gemma_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())
    return y.to(x.dtype)


def rope_cos_sin(cfg: M3Config, positions: torch.Tensor, dtype: torch.dtype):
    if cfg.rope_yarn is not None:
        raise NotImplementedError("the dense reference has plain RoPE only; YaRN is checked against transformers")
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float32)
                                         / cfg.rotary_dim))
    angle = positions.float()[:, None] * inv_freq[None, :]          # [S, half]
    return angle.cos().to(dtype), angle.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first 2*half channels of every head. x: [S, heads, D]."""
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s, rest], dim=-1)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(-limit, limit)
    return (g * torch.sigmoid(alpha * g) * (u + 1.0)).to(gate.dtype)


class ReferenceM3:
    """MiniMax-M3 text model as plain functions over a weight dict (canonical names)."""

    def __init__(self, cfg: M3Config, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = weights

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        h = swiglu_oai(x @ w[p + "gate_proj.weight"].t(), x @ w[p + "up_proj.weight"].t(),
                       self.cfg.swiglu_alpha, self.cfg.swiglu_limit)
        return h @ w[p + "down_proj.weight"].t()

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        logits = x.float() @ w[p + "gate.weight"].float().t()                    # [S, E]
        scores = torch.sigmoid(logits)
        choice = scores + w[p + "e_score_correction_bias"].float()
        sel = torch.topk(choice, cfg.num_experts_per_tok, dim=-1).indices      # [S, K]
        weights = scores.gather(1, sel)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros(x.shape[0], cfg.hidden_size, dtype=torch.float32)
        for t in range(x.shape[0]):
            for k in range(sel.shape[1]):
                e = int(sel[t, k])
                q = f"{p}experts.{e}."
                h = swiglu_oai(x[t] @ w[q + "w1.weight"].t(), x[t] @ w[q + "w3.weight"].t(),
                               cfg.swiglu_alpha, cfg.swiglu_limit)
                out[t] += weights[t, k] * (h @ w[q + "w2.weight"].t()).float()
        shared = self._mlp(p + "shared_experts.", x).float()
        return (cfg.routed_scaling_factor * out + shared).to(x.dtype)

    def _select_blocks(self, p: str, xn: torch.Tensor, positions, cos, sin) -> torch.Tensor:
        """Indexer: [S, n_index_heads, topk] logical block ids, -1 padded."""
        cfg, w = self.cfg, self.w
        S, bs = xn.shape[0], cfg.index_block_size
        iq = (xn @ w[p + "index_q_proj.weight"].t()).view(S, cfg.index_n_heads, cfg.index_head_dim)
        ik = (xn @ w[p + "index_k_proj.weight"].t()).view(S, 1, cfg.index_head_dim)
        iq = apply_rope(gemma_rms_norm(iq, w[p + "index_q_norm.weight"], cfg.rms_norm_eps), cos, sin)
        ik = apply_rope(gemma_rms_norm(ik, w[p + "index_k_norm.weight"], cfg.rms_norm_eps), cos, sin)
        sel = torch.full((S, cfg.index_n_heads, cfg.index_topk_blocks), -1, dtype=torch.long)
        for t in range(S):
            pos = int(positions[t])
            n_blocks = pos // bs + 1
            scores = iq[t].float() @ ik[: pos + 1, 0].float().t()              # [Hi, pos+1]
            padded = torch.full((cfg.index_n_heads, n_blocks * bs), -math.inf)
            padded[:, : pos + 1] = scores
            block_scores = padded.view(cfg.index_n_heads, n_blocks, bs).amax(-1)
            own = pos // bs
            for b in range(max(0, own - cfg.index_local_blocks + 1), own + 1):
                block_scores[:, b] = math.inf
            for b in range(min(cfg.index_init_blocks, n_blocks)):
                block_scores[:, b] = math.inf
            k = min(cfg.index_topk_blocks, n_blocks)
            sel[t, :, :k] = torch.topk(block_scores, k, dim=-1).indices
        return sel

    def _reuses_selection(self, i: int) -> bool:
        """Cross-layer top-k reuse, written out from the config's numbers: sparse layer i, the
        n-th sparse layer, skips its indexer unless max(n - offset, 0) is a multiple of F."""
        cfg = self.cfg
        n = sum(1 for j in range(i) if cfg.layer_types[j] == "minimax_m3_sparse")
        return max(n - cfg.index_skip_topk_offset, 0) % cfg.index_topk_freq != 0

    def _attention(self, i: int, xn: torch.Tensor, positions, cos, sin, selections: list):
        cfg, w = self.cfg, self.w
        p = f"model.layers.{i}.self_attn."
        S, D, H, G = xn.shape[0], cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q = (xn @ w[p + "q_proj.weight"].t()).view(S, H, D)
        k = (xn @ w[p + "k_proj.weight"].t()).view(S, G, D)
        v = (xn @ w[p + "v_proj.weight"].t()).view(S, G, D)
        q = apply_rope(gemma_rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps), cos, sin)
        k = apply_rope(gemma_rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps), cos, sin)
        allowed = positions[None, :] <= positions[:, None]                       # [S, S] causal
        allowed = allowed[:, None, :].expand(S, G, S)                           # per KV group
        if cfg.is_sparse(i):
            # cross-layer top-k reuse: this layer attends with the latest selection made
            sel = selections[-1] if self._reuses_selection(i) else self._select_blocks(p, xn, positions, cos, sin)
            selections.append(sel)
            key_block = positions // cfg.index_block_size                        # [S]
            in_sel = (key_block[None, None, :, None] == sel[:, :, None, :]).any(-1)  # [S, G, S]
            allowed = allowed & in_sel
        group_of_head = torch.arange(H) // (H // G)
        mask = allowed[:, group_of_head, :]                                     # [S, H, S]
        scores = torch.einsum("shd,thd->hst", q.float(), k.float()[:, group_of_head]) / math.sqrt(D)
        scores = scores.masked_fill(~mask.permute(1, 0, 2), -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hst,thd->shd", probs, v.float()[:, group_of_head]).to(xn.dtype)
        return out.reshape(S, H * D) @ w[p + "o_proj.weight"].t()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor):
        """input_ids: [S] -> (logits [S, V] fp32, selections: list of [S, Hi, topk] per sparse layer)."""
        cfg, w = self.cfg, self.w
        positions = torch.arange(input_ids.shape[0])
        x = w["model.embed_tokens.weight"][input_ids]
        cos, sin = rope_cos_sin(cfg, positions, x.dtype)
        selections: list[torch.Tensor] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            xn = gemma_rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            x = x + self._attention(i, xn, positions, cos, sin, selections)
            xn = gemma_rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            x = x + (self._moe(p + "block_sparse_moe.", xn) if cfg.is_moe(i)
                     else self._mlp(p + "mlp.", xn))
        x = gemma_rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)
        return (x @ w["lm_head.weight"].t()).float(), selections
