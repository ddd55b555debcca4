"""The attention module of MiniMax-M3 (dense layers and MSA sparse layers: indexer selection +
block-restricted attention) over the paged caches; per call `layers/dispatch.py` picks the Triton
kernels, the CPU path (`layers/cpu_attention.py`) or the PyTorch references (`kernels/ref/`).

Cache layouts (one block = one page of `block_size` tokens, block ids shared by both groups):
  main cache  kv_cache    [2, num_blocks, block_size, num_kv_heads, head_dim]  (K plane, V plane)
  index cache index_cache [num_blocks, block_size, index_head_dim]             (indexer layers)
With cross-layer top-k reuse (`M3Config.index_topk_freq` > 1) a sparse layer that skips its
indexer has no index projection, norms or cache: it attends with the selection the forward's
latest indexer layer left in the `SharedSelection` passed down the layers.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from m3serve.distributed import GroupInfo
# the ops' one PyTorch reference each (the CPU path; `paged_attention_ref` stays importable here)
from m3serve.kernels.ref.indexer import index_topk_ref
from m3serve.kernels.ref.paged_attention import paged_attention_ref
from m3serve.layers import probes
from m3serve.layers.attention_metadata import AttentionMetadata, write_cache_ref
from m3serve.layers.cpu_attention import attention_cpu, index_topk_cpu
from m3serve.layers.dispatch import select
from m3serve.layers.linear import QKVParallelLinear, RowParallelLinear, kv_head_range
from m3serve.layers.norm import RMSNorm, gemma_rms_norm
from m3serve.layers.rotary import apply_rotary


class SharedSelection:
    """The block selection one forward's indexer layers hand to the sparse layers that reuse it
    (cross-layer top-k reuse): `block_ids` [T, Hi_local, topk] int32 of the latest indexer layer
    that ran, None before the first. One per forward; under a CUDA graph the tensor is the
    captured indexer's output, so every replay finds it at the same address."""

    def __init__(self):
        self.block_ids: torch.Tensor | None = None


class Attention(nn.Module):
    """Self-attention of one layer: fused q/k/v(/index) projection, per-head Gemma QK norm,
    partial NeoX RoPE, cache writes, dense or MSA block-sparse paged attention, o_proj.
    `sparse` forces MSA with an indexer of its own (the MTP layer) or dense attention (DSpark);
    None follows the config's layer schedule, cross-layer top-k reuse included."""

    def __init__(self, cfg, layer_id: int, tp: GroupInfo, dtype: torch.dtype, sparse: bool | None = None):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.is_sparse = cfg.is_sparse(layer_id) if sparse is None else sparse
        # runs its own indexer (else it reuses an earlier layer's selection: no index weights or cache)
        self.computes_index = self.is_sparse and (sparse is not None or cfg.computes_index(layer_id))
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = kv_head_range(cfg.num_key_value_heads, tp)[1]
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, tp, dtype,
            index_heads=cfg.index_n_heads if self.computes_index else 0,
            index_dim=cfg.index_head_dim if self.computes_index else 0)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, tp, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        if self.computes_index:
            self.indexer = Indexer(cfg, dtype)
        self.kv_cache: torch.Tensor | None = None      # bound by the model runner
        self.index_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None       # [1] fp32 each, set with an fp8 cache
        self.v_scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, shared: SharedSelection | None = None,
                x_quant: tuple | None = None) -> torch.Tensor:
        """x: [T, hidden] (normalised) -> [T, hidden]. `shared`: the forward's hand-over of block
        selections (an indexer layer leaves its selection there, a reusing layer reads it);
        required by a layer that reuses. `x_quant`: x's per-token FP8 form for an online-FP8
        qkv projection (`layers/linear.apply_linear`)."""
        T, D = x.shape[0], self.head_dim
        parts = self.qkv_proj(x, x_quant)
        q = parts[0].view(T, self.num_heads, D)
        k = parts[1].view(T, self.num_kv_heads, D)
        v = parts[2].view(T, self.num_kv_heads, D)
        path = select("attention", x, has_cpu_path=True)
        if path == "triton":
            o = self._forward_triton(q, k, v, parts, cos, sin, meta, shared)
        else:
            o = self._forward_reference(q, k, v, parts, cos, sin, meta, shared, cpu_path=path == "cpu")
        return self.o_proj(o.reshape(T, self.num_heads * D))

    def _forward_reference(self, q, k, v, parts, cos, sin, meta, shared, cpu_path: bool = False):
        """The reference ops, or with `cpu_path` the CPU path of the attention and top-k ops
        (`layers/cpu_attention.py`, the same results)."""
        eps = self.cfg.rms_norm_eps
        q = apply_rotary(gemma_rms_norm(q, self.q_norm.weight, eps), cos, sin)
        k = apply_rotary(gemma_rms_norm(k, self.k_norm.weight, eps), cos, sin)
        write_cache_ref(self.kv_cache[0], k, meta.slot_mapping, self.k_scale)
        write_cache_ref(self.kv_cache[1], v, meta.slot_mapping, self.v_scale)
        block_ids = None
        if self.computes_index:
            block_ids = self.indexer(parts[3], parts[4], cos, sin, self.index_cache, meta, cpu_path)
        block_ids = self._hand_over(block_ids, shared, q.shape[0])
        if cpu_path:
            return attention_cpu(q, self.kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                 self.scale, block_ids=block_ids, k_scale=self.k_scale, v_scale=self.v_scale)
        return paged_attention_ref(q, self.kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                   self.scale, block_ids=block_ids, max_query_len=meta.max_query_len,
                                   max_seq_len=meta.max_seq_len, k_scale=self.k_scale, v_scale=self.v_scale)

    def _forward_triton(self, q, k, v, parts, cos, sin, meta, shared):
        from m3serve.kernels.indexer import index_topk
        from m3serve.kernels.paged_attention import paged_attention
        from m3serve.kernels.qk_norm_rope import qk_norm_rope_cache

        cfg, T = self.cfg, q.shape[0]
        iq = ik = None
        if self.computes_index:
            iq = parts[3].view(T, -1, cfg.index_head_dim)
            ik = parts[4]
        q, iq = qk_norm_rope_cache(
            q, k, v, iq, ik, self.q_norm.weight, self.k_norm.weight,
            self.indexer.q_norm.weight if self.computes_index else None,
            self.indexer.k_norm.weight if self.computes_index else None, cos, sin, self.kv_cache,
            self.index_cache if self.computes_index else None, meta.slot_mapping, cfg.rms_norm_eps,
            k_scale=self.k_scale, v_scale=self.v_scale)
        block_ids = None
        if self.computes_index:
            block_ids = index_topk(iq, self.index_cache, meta.query_start_loc, meta.seq_lens,
                                   meta.block_tables, block_size=meta.block_size,
                                   topk=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks,
                                   init_blocks=cfg.index_init_blocks, max_seq_len=meta.max_seq_len,
                                   max_query_len=meta.max_query_len)
        block_ids = self._hand_over(block_ids, shared, T)
        return paged_attention(q, self.kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               self.scale, block_ids=block_ids, max_query_len=meta.max_query_len,
                               max_seq_len=meta.max_seq_len, k_scale=self.k_scale, v_scale=self.v_scale)

    def _hand_over(self, block_ids: torch.Tensor | None, shared: SharedSelection | None,
                   num_tokens: int) -> torch.Tensor | None:
        """The selection this layer attends with ([T, Hi_local, topk] int32; None on a dense
        layer): its own, left in `shared` for the layers that reuse it, or the one found there."""
        if self.computes_index:
            if shared is not None:
                shared.block_ids = block_ids
        elif self.is_sparse:
            block_ids = shared.block_ids if shared is not None else None
            if block_ids is None or block_ids.shape[0] != num_tokens:
                raise RuntimeError(f"layer {self.layer_id} reuses the block selection of an earlier "
                                   f"indexer layer, but no selection of this forward's {num_tokens} "
                                   f"tokens was handed over")
        if block_ids is not None and probes.active is not None:
            probes.active.record(probes.SPARSE_BLOCKS, self.layer_id, block_ids)
        return block_ids


class Indexer(nn.Module):
    """Lightning indexer of an MSA layer: index q/k norms + RoPE, index-cache write, top-k blocks.
    Its q/k projections live in the layer's fused `qkv_proj`."""

    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.q_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps, dtype)

    def forward(self, iq: torch.Tensor, ik: torch.Tensor, cos, sin, index_cache: torch.Tensor,
                meta: AttentionMetadata, cpu_path: bool = False) -> torch.Tensor:
        """iq: [T, Hi_local * Di]; ik: [T, Di] -> block ids [T, Hi_local, topk] int32 (-1 padded);
        the top-k by its reference, or with `cpu_path` by the CPU path."""
        cfg, T, Di = self.cfg, iq.shape[0], self.cfg.index_head_dim
        iq = apply_rotary(gemma_rms_norm(iq.view(T, -1, Di), self.q_norm.weight, cfg.rms_norm_eps), cos, sin)
        ik = apply_rotary(gemma_rms_norm(ik.view(T, 1, Di), self.k_norm.weight, cfg.rms_norm_eps), cos, sin)
        write_cache_ref(index_cache, ik[:, 0], meta.slot_mapping)
        if cpu_path:
            return index_topk_cpu(iq, index_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                  block_size=meta.block_size, topk=cfg.index_topk_blocks,
                                  local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks)
        return index_topk_ref(iq, index_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                              block_size=meta.block_size, topk=cfg.index_topk_blocks,
                              local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks,
                              max_seq_len=meta.max_seq_len, max_query_len=meta.max_query_len)
