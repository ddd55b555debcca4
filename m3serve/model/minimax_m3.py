"""The serving MiniMax-M3 text model: decoder layers over paged KV caches, built per TP rank.

Weight names (final; what `named_parameters` yields and the loader fills):
  model.embed_tokens.weight, model.norm.weight, lm_head.weight
  model.layers.N.{input,post_attention}_layernorm.weight
  model.layers.N.self_attn.{qkv_proj,o_proj,q_norm,k_norm}.weight   (qkv_proj = q|k|v[|index_q|index_k])
  model.layers.N.self_attn.indexer.{q_norm,k_norm}.weight           (sparse layers)
  model.layers.N.mlp.{gate_up_proj,down_proj}.weight                (dense MLP layers)
  model.layers.N.mlp.gate.{weight,e_score_correction_bias}, mlp.experts.{w13,w2},
  model.layers.N.mlp.shared_experts.{gate_up_proj,down_proj}.weight (MoE layers)
"""
from __future__ import annotations

import torch
from torch import nn

from m3serve.distributed import TPInfo
from m3serve.layers.attention import Attention
from m3serve.layers.attention_metadata import AttentionMetadata
from m3serve.layers.dispatch import use_triton
from m3serve.layers.linear import attach_loader, linear, make_param, replicated_loader
from m3serve.layers.moe import MoE, DenseMLP
from m3serve.layers.norm import RMSNorm
from m3serve.layers.rotary import RotaryEmbedding
from m3serve.model.config import M3Config


class DecoderLayer(nn.Module):
    def __init__(self, cfg: M3Config, layer_id: int, tp: TPInfo, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer_id, tp, dtype)
        self.mlp = (MoE(cfg, tp, dtype) if cfg.is_moe(layer_id) else
                    DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.swiglu_alpha,
                             cfg.swiglu_limit, tp, dtype))

    def forward(self, x, residual, cos, sin, meta):
        """Pre-norm residual block in (delta, residual) form: returns this layer's MLP output and
        the residual stream before it; the next norm adds them (fused on GPU)."""
        h, residual = add_rms_norm(x, residual, self.input_layernorm)
        h = self.self_attn(h, cos, sin, meta)
        h, residual = add_rms_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(h), residual


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm):
    """(norm(x + residual), x + residual) with the sum rounded to x's dtype (the HF order);
    residual None means x is the residual stream itself."""
    if use_triton("rms_norm", x):
        from m3serve.kernels.rmsnorm import fused_add_rms_norm, rms_norm
        if residual is None:
            return rms_norm(x, norm.weight, norm.eps), x
        return fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    s = x if residual is None else x + residual
    return norm(s), s


class VocabEmbedding(nn.Module):
    """Embedding table, replicated on every rank (vocab parallelism is a later optimisation)."""

    def __init__(self, vocab: int, hidden: int, dtype):
        super().__init__()
        self.weight = attach_loader(make_param((vocab, hidden), dtype), replicated_loader, [None])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class TextModel(nn.Module):
    def __init__(self, cfg: M3Config, tp: TPInfo, dtype):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)


class MiniMaxM3ForCausalLM(nn.Module):
    """MiniMax-M3 text backbone + head for one TP rank.

    `forward(input_ids [T], positions [T], meta)` -> final hidden states [T, H]; the caches must
    have been bound with `bind_kv_caches`. `compute_logits(hidden [N, H])` -> fp32 [N, V].
    """

    def __init__(self, cfg: M3Config, tp: TPInfo = TPInfo(), dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.cfg, self.tp, self.dtype = cfg, tp, dtype
        self.model = TextModel(cfg, tp, dtype)
        self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def bind_kv_caches(self, kv_caches: list[torch.Tensor], index_caches: list[torch.Tensor | None]):
        """kv_caches[i]: [2, num_blocks, block_size, G_local, D] per layer; index_caches[i]:
        [num_blocks, block_size, Di] for sparse layers, None for dense ones."""
        for attn, kv, idx in zip(self.attention_layers, kv_caches, index_caches, strict=True):
            attn.kv_cache, attn.index_cache = kv, idx

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        m = self.model
        x = m.embed_tokens(input_ids)
        cos, sin = m.rotary.cos_sin(positions, x.dtype)
        residual = None
        for layer in m.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        return add_rms_norm(x, residual, m.norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight).float()
