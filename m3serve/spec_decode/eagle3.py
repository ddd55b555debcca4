"""The EAGLE3 draft head (Inferact/MiniMax-M3-EAGLE3 and -GQA): `fc` over the target's tapped
residual streams, one Llama decoder layer with its own paged KV cache, a final RMSNorm and a
head over the draft vocabulary (mapped to target ids by `d2t`); embedding (and, without its
own, the head) shared with the target.

Forward at position t (one step of the proposer):
  a = input_layernorm(embed(token[t+1])); b = hidden_norm(g); residual = g (b with
  norm_before_residual); x = attention(concat(a, b)) + residual; prenorm = mlp(post_norm(x)) + x;
  out = norm(prenorm) -> logits. g is fc(taps) on the proposer's first pass, the previous step's
  prenorm after it. Norms are standard RMSNorm; RoPE rotates every channel with the draft theta.

Checkpoint: `midlayer.*` (= layers.0), `fc.weight`, `norm.weight`, optional `lm_head.weight`
[draft_vocab, H] and `embed_tokens.weight`, `d2t` (draft id -> target id - draft id), `t2d`
(ignored); loaded with the target loader's strict checks (every tensor named on error).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from m3serve.core.kv_cache.specs import CacheGroupSpec
from m3serve.distributed import GroupInfo
from m3serve.kernels.ref.paged_attention import paged_attention_ref
from m3serve.layers.attention_metadata import AttentionMetadata, write_cache_ref
from m3serve.layers.dispatch import use_triton
from m3serve.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                   RowParallelLinear, attach_loader, kv_head_range, make_param)
from m3serve.layers.norm import RMSNorm
from m3serve.layers.rotary import RotaryEmbedding, apply_rotary
from m3serve.model.config import M3Config, read_config_json
from m3serve.spec_decode.drafter import Drafter


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool = False
    logit_scale: float = 1.0


def _bad(field: str, value, why: str, path) -> ValueError:
    return ValueError(f"EAGLE3 draft config {path}: {field!r} {why} (got {value!r})")


def load_eagle3_config(draft_dir: Path, target: M3Config) -> Eagle3Config:
    """Read and check the draft's config.json against the target it drafts for."""
    path = Path(draft_dir) / "config.json"
    raw = read_config_json(draft_dir, "EAGLE3 draft")
    eagle = raw.get("eagle_config") or {}
    L = target.num_hidden_layers
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(sorted(ids)) if ids else (2, L // 2, L - 3)
    for name in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if not isinstance(raw.get(name), int) or raw[name] <= 0:
            raise _bad(name, raw.get(name), "must be a positive integer", path)
    H, heads = raw["hidden_size"], raw["num_attention_heads"]
    kv = raw.get("num_key_value_heads", heads)
    head_dim = raw.get("head_dim") or H // heads
    if raw.get("num_hidden_layers", 1) != 1:
        raise _bad("num_hidden_layers", raw.get("num_hidden_layers"), "must be 1 (one draft layer)", path)
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise _bad("attention_bias", True, "is not supported", path)
    if raw.get("hidden_act", "silu") != "silu":
        raise _bad("hidden_act", raw.get("hidden_act"), "must be 'silu'", path)
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag) or eagle.get(flag):
            raise _bad(flag, True, "is not supported", path)
    if eagle.get("use_aux_hidden_state") is False:
        raise _bad("eagle_config.use_aux_hidden_state", False, "must be true (EAGLE3 taps)", path)
    if H != target.hidden_size:
        raise _bad("hidden_size", H, f"must equal the target's hidden size {target.hidden_size} "
                   f"(the embedding is shared)", path)
    target_hidden = raw.get("target_hidden_size", H)
    if target_hidden != target.hidden_size:
        raise _bad("target_hidden_size", target_hidden, f"must equal the target's {target.hidden_size}", path)
    vocab = raw.get("vocab_size", target.vocab_size)
    if vocab != target.vocab_size:
        raise _bad("vocab_size", vocab, f"must equal the target's {target.vocab_size}", path)
    draft_vocab = raw.get("draft_vocab_size") or vocab
    if not 0 < draft_vocab <= vocab:
        raise _bad("draft_vocab_size", draft_vocab, f"must be in [1, {vocab}]", path)
    if heads % kv or len(ids) != 3 or not all(0 <= i < L for i in ids):
        raise _bad("eagle_aux_hidden_state_layer_ids", list(ids), f"must be 3 layer ids in [0, {L})"
                   if len(ids) != 3 or not all(0 <= i < L for i in ids) else "num_key_value_heads "
                   "must divide num_attention_heads", path)
    rope = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    return Eagle3Config(H, heads, kv, head_dim, raw["intermediate_size"], raw.get("rms_norm_eps", 1e-6),
                        float(theta), vocab, draft_vocab, target_hidden, ids,
                        bool(raw.get("norm_before_residual", False)), float(raw.get("logit_scale", 1.0)))


class Eagle3Draft(nn.Module):
    """The draft for one rank: its layer split over `tp` (or replicated with a one-rank group)."""

    def __init__(self, cfg: Eagle3Config, tp: GroupInfo, dtype: torch.dtype, own_lm_head: bool,
                 own_embedding: bool):
        super().__init__()
        from m3serve.model.minimax_m3 import ParallelLMHead, VocabParallelEmbedding

        self.cfg, self.tp, self.dtype = cfg, tp, dtype
        H, D = cfg.hidden_size, cfg.head_dim
        self.fc = ReplicatedLinear(3 * cfg.target_hidden_size, H, dtype)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype, offset=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, dtype, offset=False)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype, offset=False)
        self.qkv_proj = QKVParallelLinear(2 * H, D, cfg.num_attention_heads, cfg.num_key_value_heads, tp, dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * D, H, tp, dtype)
        self.gate_up_proj = MergedColumnParallelLinear(H, [cfg.intermediate_size] * 2, tp, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, H, tp, dtype)
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype, offset=False)
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = kv_head_range(cfg.num_key_value_heads, tp)[1]
        self.rotary = RotaryEmbedding(D, cfg.rope_theta)
        self.scale = 1.0 / math.sqrt(D)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, H, tp, dtype) if own_lm_head else None
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H, tp, dtype) if own_embedding else None
        d2t = attach_loader(make_param((cfg.draft_vocab_size,), torch.int64), _copy_loader, [None])
        self.d2t = d2t if cfg.draft_vocab_size != cfg.vocab_size else None
        self.kv_cache: torch.Tensor | None = None     # [2, num_blocks, block_size, G_local, D]

    # ------------------------------------------------------------ forward

    def combine(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's concatenated taps [T, 3H] -> the layer's hidden input g [T, H]."""
        return self.fc(taps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds: [T, H] (of the next tokens), hidden: [T, H] -> (normed out, prenorm) [T, H]."""
        T, D = embeds.shape[0], self.cfg.head_dim
        a = self.input_layernorm(embeds)
        b = self.hidden_norm(hidden)
        residual = b if self.cfg.norm_before_residual else hidden
        q, k, v = self.qkv_proj(torch.cat([a, b], dim=-1))
        cos, sin = self.rotary.cos_sin(positions, embeds.dtype)
        q = apply_rotary(q.view(T, self.num_heads, D), cos, sin)
        k = apply_rotary(k.view(T, self.num_kv_heads, D), cos, sin)
        v = v.view(T, self.num_kv_heads, D)
        o = self._attention(q, k, v, meta)
        x = self.o_proj(o.reshape(T, self.num_heads * D)) + residual
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        prenorm = self.down_proj(torch.nn.functional.silu(gate) * up) + x
        return self.norm(prenorm), prenorm

    def _attention(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        cache = self.kv_cache
        if use_triton("attention", q):
            from m3serve.kernels.paged_attention import paged_attention
            G, D = cache.shape[3], cache.shape[4]
            cache[0].view(-1, G, D).index_copy_(0, meta.slot_mapping, k.to(cache.dtype))
            cache[1].view(-1, G, D).index_copy_(0, meta.slot_mapping, v.to(cache.dtype))
            return paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                   self.scale, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)
        write_cache_ref(cache[0], k, meta.slot_mapping)
        write_cache_ref(cache[1], v, meta.slot_mapping)
        return paged_attention_ref(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                   self.scale, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)

    def next_tokens(self, out: torch.Tensor, target_head) -> torch.Tensor:
        """Greedy draft tokens (target ids) [N] from the normed outputs [N, H]."""
        head = self.lm_head if self.lm_head is not None else target_head
        local = head.local_logits(out)
        if self.cfg.logit_scale != 1.0:
            local = local * self.cfg.logit_scale
        ids = head.greedy(local)
        if self.d2t is not None and self.lm_head is not None:
            ids = ids + self.d2t[ids]
        return ids


class Eagle3Drafter(Drafter):
    """The EAGLE3 head as a draft kind: one cache group ("draft"), the target's taps in."""

    def __init__(self, draft: Eagle3Draft, target, device: torch.device, taps: tuple[int, ...]):
        super().__init__(draft, target, device)
        self.taps = taps

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        own = self.draft.embed_tokens
        return (own if own is not None else self.target.model.embed_tokens)(ids)

    def cache_specs(self, kv_bytes: int, index_bytes: int) -> list[CacheGroupSpec]:
        d = self.draft
        kv_bytes = d.dtype.itemsize if kv_bytes == 1 else kv_bytes      # never fp8 (allocate_caches)
        return [CacheGroupSpec("draft", (0,), 2 * d.num_kv_heads * d.cfg.head_dim * kv_bytes)]

    def cache_planes(self) -> list[tuple[str, torch.Tensor]]:
        return [("draft", self.draft.kv_cache[0]), ("draft", self.draft.kv_cache[1])]

    def attention_kernels(self):
        return [(self.draft.num_heads, self.draft.kv_cache, False, False, None, None)]

    def allocate_caches(self, num_blocks: int, block_size: int, kv_dtype, index_dtype) -> None:
        d = self.draft
        # the draft's K/V stay in the model dtype with an fp8 target cache (it has no cache scales)
        dtype = d.dtype if kv_dtype == torch.float8_e4m3fn else kv_dtype
        d.kv_cache = torch.zeros(2, num_blocks, block_size, d.num_kv_heads, d.cfg.head_dim, dtype=dtype,
                                 device=self.device)

    def prepare(self, embeds, hidden, positions, meta, last_index):
        d = self.draft
        out, prenorm = d(embeds, d.combine(hidden), positions, meta)
        return d.next_tokens(out[last_index], self.target.lm_head), prenorm[last_index]

    def propose(self, step, embeds, state, positions, meta):
        out, state = self.draft(embeds, state, positions, meta)
        return self.draft.next_tokens(out, self.target.lm_head), state


def _copy_loader(param, full: torch.Tensor, shard_id=None) -> None:
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"shape mismatch: checkpoint has {tuple(full.shape)}, model expects {tuple(param.shape)}")
    param.data.copy_(full)


# ---------------------------------------------------------------- checkpoint

_LAYER_NAMES = {
    "self_attn.q_proj.weight": ("qkv_proj.weight", "q"), "self_attn.k_proj.weight": ("qkv_proj.weight", "k"),
    "self_attn.v_proj.weight": ("qkv_proj.weight", "v"), "self_attn.o_proj.weight": ("o_proj.weight", None),
    "mlp.gate_proj.weight": ("gate_up_proj.weight", 0), "mlp.up_proj.weight": ("gate_up_proj.weight", 1),
    "mlp.down_proj.weight": ("down_proj.weight", None),
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "hidden_norm.weight": ("hidden_norm.weight", None),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", None),
}


def eagle3_shapes(cfg: Eagle3Config, own_lm_head: bool, own_embedding: bool) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names (midlayer. -> layers.0.) and full shapes of an EAGLE3 checkpoint."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    p = "layers.0."
    shapes = {"fc.weight": (H, 3 * cfg.target_hidden_size), "norm.weight": (H,),
              p + "self_attn.q_proj.weight": (cfg.num_attention_heads * D, 2 * H),
              p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * D, 2 * H),
              p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * D, 2 * H),
              p + "self_attn.o_proj.weight": (H, cfg.num_attention_heads * D),
              p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
              p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
              p + "hidden_norm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    if own_lm_head:
        shapes["lm_head.weight"] = (cfg.draft_vocab_size, H)
    if own_embedding:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, H)
    if cfg.draft_vocab_size != cfg.vocab_size:
        shapes["d2t"] = (cfg.draft_vocab_size,)
    return shapes


def canonical_eagle3_name(name: str) -> str | None:
    """Checkpoint name -> canonical (None: ignored, `t2d`)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    return None if name == "t2d" else name


def eagle3_to_param(name: str) -> tuple[str, object]:
    if name.startswith("layers.0."):
        return _LAYER_NAMES[name[len("layers.0."):]]
    return name, None
