"""MiniMax-M3's multi-token-prediction modules as a draft: module m = `enorm`, `hnorm`,
`eh_proj` [H, 2H], one MSA + MoE decoder layer with its own KV and index caches, and
`final_layernorm`; the target's embedding and head.

Forward of module m at position t:
  e = embed(token[t+1]) (0 at position 0); z = eh_proj(concat(enorm(e), hnorm(h_prev[t])));
  h_new = layer(z) (the un-normalised residual output); logits = lm_head(final_layernorm(h_new)).
h_prev is the target's final hidden state on the proposer's first pass, the previous step's
h_new after it; draft step s uses module s mod num_mtp_modules, so only modules
0 .. min(k, M) - 1 are loaded.

Tensors `mtp.layers.{m}.*` come bundled in the target checkpoint (prefix
`language_model.model.`) or in a standalone checkpoint (prefix `model.`, `model_type`
"minimax_m3_mtp"); the layer's tensors use the target's names and sharding.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from m3serve.core.kv_cache.specs import CacheGroupSpec
from m3serve.distributed import ParallelInfo
from m3serve.layers.attention_metadata import AttentionMetadata
from m3serve.layers.linear import ReplicatedLinear
from m3serve.layers.norm import RMSNorm
from m3serve.model.config import M3Config, layer_shapes
from m3serve.spec_decode.drafter import Drafter

_MTP = re.compile(r"^(?:language_model\.model\.|model\.)?mtp\.layers\.(\d+)\.(.+)$")


class MTPModule(nn.Module):
    def __init__(self, cfg: M3Config, parallel: ParallelInfo, dtype, index: int):
        super().__init__()
        from m3serve.model.minimax_m3 import DecoderLayer

        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(H, eps, dtype)
        self.hnorm = RMSNorm(H, eps, dtype)
        self.final_layernorm = RMSNorm(H, eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * H, H, dtype)
        # reports to layers/probes.py as layer num_hidden_layers + index, after the target's
        self.layer = DecoderLayer(cfg, cfg.num_hidden_layers + index, parallel, dtype, sparse_moe=True)

    def forward(self, embeds: torch.Tensor, h_prev: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """embeds: [T, H] of the next tokens; h_prev: [T, H] -> h_new [T, H]."""
        embeds = torch.where((positions == 0)[:, None], torch.zeros_like(embeds), embeds)
        z = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(h_prev)], dim=-1))
        x, residual = self.layer(z, None, cos, sin, meta)
        return x + residual


class MTPDraft(nn.Module):
    """The loaded modules (`modules[i]` is module i)."""

    def __init__(self, cfg: M3Config, num_modules: int, parallel: ParallelInfo, dtype):
        super().__init__()
        self.cfg = cfg
        self.modules_ = nn.ModuleList(MTPModule(cfg, parallel, dtype, m) for m in range(num_modules))

    @property
    def attention_layers(self):
        return [m.layer.self_attn for m in self.modules_]


class MTPDrafter(Drafter):
    """The MTP modules as a draft kind: two cache groups ("mtp", "mtp_index"), the target's
    final hidden states in; draft step s runs module s mod M."""

    def cache_specs(self, kv_bytes: int, index_bytes: int) -> list[CacheGroupSpec]:
        cfg = self.draft.cfg
        layers = tuple(range(len(self.draft.modules_)))
        kv_heads = self.draft.attention_layers[0].num_kv_heads
        return [CacheGroupSpec("mtp", layers, 2 * kv_heads * cfg.head_dim * kv_bytes),
                CacheGroupSpec("mtp_index", layers, cfg.index_head_dim * index_bytes)]

    def cache_planes(self) -> list[tuple[str, torch.Tensor]]:
        planes = []
        for attn in self.draft.attention_layers:
            planes += [("mtp", attn.kv_cache[0]), ("mtp", attn.kv_cache[1]), ("mtp_index", attn.index_cache)]
        return planes

    def attention_kernels(self):
        return [(a.num_heads, a.kv_cache, a.is_sparse, False, a.k_scale, a.v_scale)
                for a in self.draft.attention_layers]

    def allocate_caches(self, num_blocks: int, block_size: int, kv_dtype, index_dtype) -> None:
        cfg, dev = self.draft.cfg, self.device
        for attn in self.draft.attention_layers:
            attn.kv_cache = torch.zeros(2, num_blocks, block_size, attn.num_kv_heads, cfg.head_dim,
                                        dtype=kv_dtype, device=dev)
            attn.index_cache = torch.zeros(num_blocks, block_size, cfg.index_head_dim, dtype=index_dtype,
                                           device=dev)
            if kv_dtype == torch.float8_e4m3fn:
                attn.k_scale = torch.ones(1, dtype=torch.float32, device=dev)
                attn.v_scale = torch.ones(1, dtype=torch.float32, device=dev)

    def prepare(self, embeds, hidden, positions, meta, last_index):
        return self._module_step(0, embeds, hidden, positions, meta, last_index)

    def propose(self, step, embeds, state, positions, meta):
        return self._module_step(step % len(self.draft.modules_), embeds, state, positions, meta)

    def _module_step(self, m: int, embeds, h_prev, positions, meta, last_index=None):
        """Module m over the rows -> (its greedy token, its output h_new) at `last_index` rows."""
        module = self.draft.modules_[m]
        cos, sin = self.target.model.rotary.cos_sin(positions, embeds.dtype)
        h_new = module(embeds, h_prev, positions, cos, sin, meta)
        if last_index is not None:
            h_new = h_new[last_index]
        return self.target.lm_head.logits_and_greedy(module.final_layernorm(h_new))[1], h_new


def mtp_shapes(cfg: M3Config, num_modules: int) -> dict[str, tuple[int, ...]]:
    H = cfg.hidden_size
    shapes = {}
    for m in range(num_modules):
        p = f"modules_.{m}."
        shapes.update({p + "enorm.weight": (H,), p + "hnorm.weight": (H,),
                       p + "final_layernorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H)})
        shapes.update(layer_shapes(cfg, f"modules_.{m}.layer.", sparse=True, moe=True))
    return shapes


def canonical_mtp_names(name: str, tensor, num_modules: int):
    """A checkpoint tensor -> [(canonical name, tensor)] for a loaded module, [] for another
    module, None for a tensor that is not MTP's."""
    from m3serve.model.checkpoint import canonicalize

    match = _MTP.match(name)
    if not match:
        return None
    m, rest = int(match.group(1)), match.group(2)
    if m >= num_modules:
        return []
    p = f"modules_.{m}."
    if rest.startswith("transformer_layer."):
        # the target's layer naming, canonicalised as if it were layer m of the target
        pairs = canonicalize(f"model.layers.{m}." + rest[len("transformer_layer."):], tensor) or []
        return [(p + "layer." + c[len(f"model.layers.{m}."):], t) for c, t in pairs]
    return [(p + rest, tensor)]


def mtp_to_param(name: str) -> tuple[str, object]:
    from m3serve.model.loader import canonical_to_param

    m = re.match(r"^modules_\.(\d+)\.layer\.(.+)$", name)
    if not m:
        return name, None
    param, shard = canonical_to_param(f"model.layers.0.{m.group(2)}")
    return f"modules_.{m.group(1)}.layer.{param[len('model.layers.0.'):]}", shard
