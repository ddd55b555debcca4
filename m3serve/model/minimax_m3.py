"""The serving MiniMax-M3 text model: decoder layers over paged KV caches, built per TP rank.

Weight names (final; what `named_parameters` yields and the loader fills):
  model.embed_tokens.weight, model.norm.weight, lm_head.weight
  model.layers.N.{input,post_attention}_layernorm.weight
  model.layers.N.self_attn.{qkv_proj,o_proj,q_norm,k_norm}.weight   (qkv_proj = q|k|v[|index_q|index_k])
  model.layers.N.self_attn.indexer.{q_norm,k_norm}.weight           (sparse layers running the indexer)
  model.layers.N.mlp.{gate_up_proj,down_proj}.weight                (dense MLP layers)
  model.layers.N.mlp.gate.{weight,e_score_correction_bias}, mlp.experts.{w13,w2},
  model.layers.N.mlp.shared_experts.{gate_up_proj,down_proj}.weight (MoE layers)
"""
from __future__ import annotations

import torch
from torch import nn

from m3serve.distributed import GroupInfo, ParallelInfo
from m3serve.layers.attention import Attention, SharedSelection
from m3serve.layers.attention_metadata import AttentionMetadata
from m3serve.layers.dispatch import use_triton
from m3serve.layers.linear import attach_loader, check_shape, linear, make_param, takes_fp8_input
from m3serve.layers.moe import MoE, DenseMLP
from m3serve.layers.norm import RMSNorm
from m3serve.layers.rotary import RotaryEmbedding
from m3serve.model.config import M3Config


class DecoderLayer(nn.Module):
    """One decoder layer; `sparse_moe` builds an MSA + MoE layer whatever the layer schedule
    says (the MTP modules' layer, whose `layer_id` is then only the id its attention and MoE
    report under, `layers/probes.py`)."""

    def __init__(self, cfg: M3Config, layer_id: int, parallel: ParallelInfo, dtype, sparse_moe: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer_id, parallel.tp, dtype, sparse=True if sparse_moe else None)
        self.is_moe = sparse_moe or cfg.is_moe(layer_id)
        self.mlp = (MoE(cfg, parallel, dtype, layer_id) if self.is_moe else
                    DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.swiglu_alpha,
                             cfg.swiglu_limit, parallel.tp, dtype))

    def forward(self, x, residual, cos, sin, meta, shared: SharedSelection | None = None,
                fp32_out: bool = False):
        """Pre-norm residual block in (delta, residual) form: returns this layer's MLP output and
        the residual stream before it; the next norm adds them (fused on GPU). `shared`: the
        forward's block selections for cross-layer top-k reuse (`layers/attention.py`).
        `fp32_out`: an MoE layer returns its fp32 sum unrounded (the next fused norm rounds it:
        the same values, one cast kernel fewer); x may then be fp32 as well."""
        # an online-FP8 qkv / FP8 experts: the norm before also makes their per-token FP8 input
        # (bit-equal to what they would make; one launch fewer each)
        fp8 = residual is not None and takes_fp8_input(self.self_attn.qkv_proj, residual)
        h, residual, h_fp8 = add_rms_norm_maybe_fp8(x, residual, self.input_layernorm, fp8)
        h = self.self_attn(h, cos, sin, meta, shared, x_quant=h_fp8)
        fp8 = self.is_moe and self.mlp.takes_fp8_input(h)
        h, residual, h_fp8 = add_rms_norm_maybe_fp8(h, residual, self.post_attention_layernorm, fp8)
        if self.is_moe:
            return self.mlp(h, meta.dp_padded_tokens, keep_fp32=fp32_out, x_quant=h_fp8), residual
        return self.mlp(h), residual


def add_rms_norm_maybe_fp8(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, fp8: bool):
    """`add_rms_norm` -> (normed, new residual, None), or with `fp8` (a residual given, the GPU
    path) also the normed rows' per-token FP8 form in place of None
    (`kernels/rmsnorm.fused_add_rms_norm_fp8`)."""
    if fp8:
        from m3serve.kernels.rmsnorm import fused_add_rms_norm_fp8
        return fused_add_rms_norm_fp8(x, residual, norm.weight, norm.eps)
    return (*add_rms_norm(x, residual, norm), None)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm):
    """(norm(x + residual), x + residual) with the sum rounded to the stream's dtype (the HF
    order); residual None means x is the residual stream itself. x may be an MoE layer's fp32
    output (`DecoderLayer.forward`'s fp32_out), rounded to the residual's dtype first."""
    if use_triton("rms_norm", x):
        from m3serve.kernels.rmsnorm import fused_add_rms_norm, rms_norm
        if residual is None:
            return rms_norm(x, norm.weight, norm.eps), x
        return fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    if residual is not None and x.dtype != residual.dtype:
        x = x.to(residual.dtype)
    s = x if residual is None else x + residual
    return norm(s), s


class VocabParallelEmbedding(nn.Module):
    """This TP rank's rows [start, start + num_real) of a [vocab, hidden] table: ceil(V / TP) rows
    per rank, the last rank's tail zero-padded. A lookup gives zeros for ids another rank owns,
    and the all-reduce adds the one rank that owns each id."""

    def __init__(self, vocab: int, hidden: int, tp: GroupInfo, dtype):
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.rows = -(-vocab // tp.size)
        self.start = tp.rank * self.rows
        self.num_real = max(0, min(vocab - self.start, self.rows))
        self.weight = attach_loader(make_param((self.rows, hidden), dtype), self._load, [None])

    def _load(self, param, full: torch.Tensor, shard_id=None) -> None:
        check_shape(full, (self.vocab, param.shape[1]), "vocabulary-parallel weight")
        param.data[:self.num_real].copy_(full[self.start:self.start + self.num_real])
        param.data[self.num_real:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] -> [T, hidden]."""
        if self.tp.size == 1:
            if use_triton("embedding", ids):
                from m3serve.kernels.step_inputs import embedding_rows
                return embedding_rows(ids, self.weight)
            return self.weight[ids]
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_real)                    # [T]
        rows = self.weight[local.clamp(0, self.rows - 1)]                  # [T, hidden]
        return self.tp.all_reduce(torch.where(inside[:, None], rows, torch.zeros_like(rows)))


class ParallelLMHead(VocabParallelEmbedding):
    """The output head, split by vocabulary rows like the embedding. `local_logits` is this
    rank's fp32 slice (padding columns -inf); `gather` assembles the full [N, V] logits on every
    rank; `greedy` finds the argmax from each rank's best (value, id) without moving logits."""

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> fp32 [N, rows]."""
        logits = linear(hidden, self.weight).float()
        if self.num_real < self.rows:
            logits[:, self.num_real:] = float("-inf")
        return logits

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[N, rows] per rank -> [N, V]."""
        if self.tp.size == 1:
            return local
        n = local.shape[0]
        full = self.tp.all_gather(local).view(self.tp.size, n, self.rows)  # [TP, N, rows]
        return full.permute(1, 0, 2).reshape(n, self.tp.size * self.rows)[:, :self.vocab]

    def logits_and_greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [N, H] -> (`local_logits`, `greedy` of them). For decode-sized batches on the
        GPU the widening to fp32 and this rank's argmax ride in the head GEMM's epilogue
        (`kernels/gemv.skinny_head`: the same logits and ids as the two steps)."""
        from m3serve.kernels.gemv import skinny_eligible, skinny_head
        if self.num_real > 0 and skinny_eligible(hidden, self.weight) and use_triton("skinny_head", hidden):
            local, best = skinny_head(hidden, self.weight, self.num_real)
            return local, self.greedy(local, best)
        local = self.local_logits(hidden)
        return local, self.greedy(local)

    def greedy(self, local: torch.Tensor, best: torch.Tensor | None = None) -> torch.Tensor:
        """[N, rows] per rank -> argmax ids [N] int64 over the whole vocabulary; the lowest id
        among equal maxima, as a full-vocabulary argmax gives. best: this rank's argmax of
        `local` when already known."""
        if best is None:
            best = local.argmax(dim=-1)                                     # [N]
        if self.tp.size == 1:
            return best
        value = local.gather(1, best[:, None])                              # [N, 1]
        pairs = torch.cat([value, (best + self.start).to(torch.float32)[:, None]], dim=1)  # [N, 2]
        every = self.tp.all_gather(pairs).view(self.tp.size, -1, 2)        # [TP, N, 2]
        winner = every[..., 0].argmax(dim=0)                                # [N]: first max rank
        return every[..., 1].gather(0, winner[None, :])[0].to(torch.int64)


class TextModel(nn.Module):
    def __init__(self, cfg: M3Config, parallel: ParallelInfo, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel.tp, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, parallel, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_yarn)


class MiniMaxM3ForCausalLM(nn.Module):
    """MiniMax-M3 text backbone + head for one rank.

    `forward(input_ids [T], positions [T], meta)` -> final hidden states [T, H]; the caches must
    have been bound with `bind_kv_caches`. `compute_logits(hidden [N, H])` -> fp32 [N, V] on
    every rank (a collective under TP); `lm_head.local_logits` / `gather` / `greedy` split it.
    """

    def __init__(self, cfg: M3Config, parallel: ParallelInfo = ParallelInfo(),
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.cfg, self.parallel, self.tp, self.dtype = cfg, parallel, parallel.tp, dtype
        self.model = TextModel(cfg, parallel, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, parallel.tp, dtype)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def bind_kv_caches(self, kv_caches: list[torch.Tensor], index_caches: list[torch.Tensor | None]):
        """kv_caches[i]: [2, num_blocks, block_size, G_local, D] per layer; index_caches[i]:
        [num_blocks, block_size, Di] for the layers that run the indexer (`cfg.index_layer_ids`),
        None for the others (dense layers, sparse layers reusing a selection)."""
        for attn, kv, idx in zip(self.attention_layers, kv_caches, index_caches, strict=True):
            attn.kv_cache, attn.index_cache = kv, idx

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, taps: tuple[int, ...] = (), inputs_embeds: torch.Tensor | None = None):
        """-> final hidden states [T, H]; with `taps` (layer ids, ascending) also the residual
        stream entering each of those layers, concatenated: [T, len(taps) * H] (the drafts' input;
        tap num_hidden_layers is the final norm's input).
        `inputs_embeds` [T, H] replaces the token embeddings (image / video features in place of
        their placeholders)."""
        m = self.model
        x = m.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = m.rotary.cos_sin(positions, x.dtype)
        residual = None
        streams = []
        shared = SharedSelection()                     # sparse layers that skip the indexer read it
        fp32_out = use_triton("rms_norm", x)           # MoE sums stay fp32 until the next fused norm
        for i, layer in enumerate(m.layers):
            if i in taps:
                stream = x if residual is None else x.to(residual.dtype) + residual
                streams += [stream] * taps.count(i)
            x, residual = layer(x, residual, cos, sin, meta, shared, fp32_out=fp32_out)
        if len(m.layers) in taps:                      # the final norm's input (DSpark's last tap)
            streams += [x.to(residual.dtype) + residual] * taps.count(len(m.layers))
        hidden = add_rms_norm(x, residual, m.norm)[0]
        if not taps:
            return hidden
        return hidden, torch.cat(streams, dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.gather(self.lm_head.local_logits(hidden))
