"""The DSpark draft (`DSparkMiniMaxDraftModel`, shipped in a target checkpoint's `dspark/`
folder): a block-parallel drafter over a context projected from the target's hidden states.

Per step of the target (T tokens, R requests; `DSparkDrafter.first`, then `steps`):
1. Context. The target's residual streams after its layers `dspark_target_layer_ids`
   (concatenated, [T, n x H]) -> `main = hidden_norm(fc(taps))` [T, H]. For every draft layer l:
   `k = k_norm(W_k main)` with RoPE at the token's position, `v = W_v main`, written to layer l's
   paged cache at the token's slot. No input norm, attention or MLP runs on context rows.
2. Query block. Per request, k tokens `[anchor, noise x (k - 1)]` at positions p + 1 .. p + k
   (p = the last verified position, anchor = the token after it), embedded with the target's
   embedding. Each of the draft's dense layers: `x += o_proj(attn(qkv(input_norm(x))))`,
   `x += mlp(post_norm(x))` (Gemma norms, per-head q/k Gemma norms, the target's partial RoPE,
   SwiGLU-OAI). The block's K/V are written at positions p + 1 .. p + k (rewritten by the next
   step's context, like any KV past the verified tokens); a block query sees every block key
   (non-causal inside the block) and the context keys within the sliding window: key positions
   >= its own position - (sliding_window - 1).
3. Heads. `base_i = target_lm_head(final_norm(x_i))`; a sequential Markov head adds a previous-
   token bias: prev_0 = anchor, `logits_i = base_i + markov_w2 . markov_w1[prev_i]`,
   d_i = argmax, prev_{i+1} = d_i. Drafts are greedy (the verifier's rejection rule treats them
   as point masses, which keeps sampling lossless).
The confidence head (`confidence_head.proj`) is read and checked, not used: verification is
static (every request verifies all k drafts).

Caches: one paged group ("dspark", a cache per draft layer) in a pool of its own, with block
tables of its own indexed by logical block like the target's: each running request holds only
the blocks of its next queries' window (`core/kv_cache/draft_window.py`); context rows older
than that go to the null block. Full blocks are prefix-cached under the target's block hashes;
what a request's draft KV lacks (a partial hit, a CPU-tier restore, a pulled prompt) lies
below its `valid_from`, which its queries never read.

Checkpoint (`dspark/`): config.json (architectures DSparkMiniMaxDraftModel, a `text_config`
whose keys may repeat at the top level and must then agree), weights named
`language_model.model.dspark.*`: `fc`, `hidden_norm`, `final_norm`, `markov_head.markov_w{1,2}`,
`confidence_head.proj.{weight,bias}`, `layers.{l}.decoder_layer.{input_layernorm,
post_attention_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}`;
with `quantization_config.quant_method` "mxfp8" the seven projections of every layer are e4m3
codes plus `weight_scale_inv` (E8M0, one per 32 along K), read by the packed-weight kernels.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from m3serve.core.kv_cache.specs import CacheGroupSpec
from m3serve.distributed import GroupInfo
from m3serve.kernels.ref.paged_attention import paged_attention_ref
from m3serve.layers.attention import Attention
from m3serve.layers.attention_metadata import AttentionMetadata, write_cache_ref
from m3serve.layers.dispatch import use_triton
from m3serve.layers.linear import ReplicatedLinear, attach_loader, make_param, replicated_loader
from m3serve.layers.moe import DenseMLP
from m3serve.layers.norm import RMSNorm, gemma_rms_norm
from m3serve.layers.rotary import RotaryEmbedding, apply_rotary
from m3serve.model.config import FULL, M3Config
from m3serve.spec_decode.drafter import Drafter

ARCHITECTURE = "DSparkMiniMaxDraftModel"
PREFIX = "language_model.model.dspark."


@dataclass(frozen=True)
class DSparkConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_size: int
    markov_rank: int
    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]     # outputs of these target layers (0-based) are the taps
    sliding_window: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    swiglu_alpha: float
    swiglu_limit: float
    confidence_head: bool
    quant: str | None                     # None (bf16 projections) or "mxfp8"

    @property
    def taps(self) -> tuple[int, ...]:
        """The target's entering-stream taps (`MiniMaxM3ForCausalLM.forward`): the output of
        layer i is the stream entering layer i + 1 (the final norm's input for the last)."""
        return tuple(i + 1 for i in self.target_layer_ids)


def _bad(path, key: str, value, why: str) -> ValueError:
    return ValueError(f"DSpark draft config {path}: {key!r} {why} (got {value!r})")


def load_dspark_config(draft_dir: Path, target: M3Config) -> DSparkConfig:
    """Read and check `dspark/config.json` against the target it drafts for; what this engine
    does not implement (another Markov head, hybrid context fusion, MoE or sparse draft layers)
    is refused by name rather than guessed."""
    from m3serve.model.draft_files import read_dspark_config

    path = Path(draft_dir) / "config.json"
    raw, text = read_dspark_config(path)
    archs = raw.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise _bad(path, "architectures", archs, f"must list {ARCHITECTURE!r}")
    for key, value in text.items():            # keys repeated at the top level must agree
        if key in raw and key != "text_config" and raw[key] != value:
            raise _bad(path, key, raw[key], f"at the top level disagrees with text_config's {value!r}")

    def get(key, default=None, *, required=False):
        if key in text:
            return text[key]
        if key in raw:
            return raw[key]
        if required:
            raise _bad(path, key, None, "is required")
        return default

    def positive(key, default=None):
        value = get(key, default, required=default is None)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _bad(path, key, value, "must be a positive integer")
        return value

    H = positive("hidden_size")
    if H != target.hidden_size:
        raise _bad(path, "hidden_size", H, f"must equal the target's {target.hidden_size} (the "
                   f"target's embedding and head are shared)")
    vocab = positive("vocab_size", target.vocab_size)
    if vocab != target.vocab_size:
        raise _bad(path, "vocab_size", vocab, f"must equal the target's {target.vocab_size}")
    heads, kv = positive("num_attention_heads"), positive("num_key_value_heads")
    if heads % kv:
        raise _bad(path, "num_key_value_heads", kv, f"must divide num_attention_heads {heads}")
    head_dim = positive("head_dim", H // heads)
    ffn = positive("dspark_ffn_hidden_size", get("dense_intermediate_size"))
    if get("dense_intermediate_size", ffn) != ffn:
        raise _bad(path, "dspark_ffn_hidden_size", ffn,
                   f"disagrees with dense_intermediate_size {get('dense_intermediate_size')}")
    L = target.num_hidden_layers
    ids = get("dspark_target_layer_ids", required=True)
    if (not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                        and 0 <= i < L for i in ids)):
        raise _bad(path, "dspark_target_layer_ids", ids, f"must be a non-empty list of target layer ids in [0, {L})")
    if get("dspark_markov_head_type", "vanilla") != "vanilla":
        raise _bad(path, "dspark_markov_head_type", get("dspark_markov_head_type"), "must be 'vanilla' "
                   "(the only Markov head this engine implements)")
    fusion = get("dspark_hybrid_context_fusion", False) or (get("dspark_config") or {}).get(
        "hybrid_context_fusion", False)
    if fusion:
        raise _bad(path, "dspark_hybrid_context_fusion", fusion, "is not supported (must be false)")
    if get("dspark_use_dense_ffn", True) is not True:
        raise _bad(path, "dspark_use_dense_ffn", get("dspark_use_dense_ffn"), "must be true (dense draft layers)")
    n = positive("num_hidden_layers")
    freq = get("moe_layer_freq", [0] * n)
    if not isinstance(freq, list) or any(freq):
        raise _bad(path, "moe_layer_freq", freq, "must be all zeros (dense draft layers)")
    if get("sparse_attention_config") is not None:
        raise _bad(path, "sparse_attention_config", get("sparse_attention_config"), "must be null")
    types = get("layer_types", ["sliding_attention"] * n)
    if types != ["sliding_attention"] * n:
        raise _bad(path, "layer_types", types, f"must be ['sliding_attention'] * {n}")
    if get("use_gemma_norm", True) is not True:
        raise _bad(path, "use_gemma_norm", get("use_gemma_norm"), "must be true (Gemma (1 + w) norms)")
    noise = get("dspark_noise_token_id", required=True)
    if isinstance(noise, bool) or not isinstance(noise, int) or not 0 <= noise < vocab:
        raise _bad(path, "dspark_noise_token_id", noise, f"must be a token id in [0, {vocab})")
    qc = raw.get("quantization_config")
    quant = None
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if method != "mxfp8":
            raise _bad(path, "quantization_config.quant_method", method, "must be 'mxfp8' (or no "
                       "quantization_config: bf16 projections)")
        blocks = qc.get("weight_block_size", [1, 32])
        if list(blocks) != [1, 32]:
            raise _bad(path, "quantization_config.weight_block_size", blocks, "must be [1, 32]")
        quant = "mxfp8"
    rope = get("rope_parameters") or {}
    theta = float(get("rope_theta", rope.get("rope_theta", target.rope_theta)))
    partial = get("partial_rotary_factor", rope.get("partial_rotary_factor"))
    rotary = int(head_dim * partial) if partial else get("rotary_dim", target.rotary_dim)
    return DSparkConfig(
        num_layers=n, hidden_size=H, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        ffn_size=ffn, markov_rank=positive("dspark_markov_rank"), block_size=positive("dspark_block_size"),
        noise_token_id=noise, target_layer_ids=tuple(ids), sliding_window=positive("sliding_window"),
        vocab_size=vocab, rms_norm_eps=float(get("rms_norm_eps", target.rms_norm_eps)), rope_theta=theta,
        rotary_dim=rotary, swiglu_alpha=float(get("swiglu_alpha", target.swiglu_alpha)),
        swiglu_limit=float(get("swiglu_limit", target.swiglu_limit)),
        confidence_head=bool(get("enable_confidence_head", False)), quant=quant)


# ---------------------------------------------------------------- the module

class DSparkLayer(nn.Module):
    """One dense draft layer: the target's attention projections (without an indexer) and a
    SwiGLU-OAI MLP, with their own forward (`DSparkDraft`)."""

    def __init__(self, layer_cfg: M3Config, tp: GroupInfo, dtype: torch.dtype):
        super().__init__()
        H = layer_cfg.hidden_size
        self.input_layernorm = RMSNorm(H, layer_cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(H, layer_cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(layer_cfg, 0, tp, dtype, sparse=False)
        self.mlp = DenseMLP(H, layer_cfg.dense_intermediate_size, layer_cfg.swiglu_alpha,
                            layer_cfg.swiglu_limit, tp, dtype)


class DSparkDraft(nn.Module):
    """The draft for one rank: its layers split over `tp` (or replicated with a one-rank group);
    the Markov head's second matrix split over the vocabulary like the target's head."""

    def __init__(self, cfg: DSparkConfig, target_cfg: M3Config, tp: GroupInfo, head_tp: GroupInfo,
                 dtype: torch.dtype):
        super().__init__()
        from m3serve.model.minimax_m3 import ParallelLMHead

        self.cfg, self.dtype = cfg, dtype
        H = cfg.hidden_size
        self.layer_cfg = dataclasses.replace(
            target_cfg, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            dense_intermediate_size=cfg.ffn_size, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
            rotary_dim=cfg.rotary_dim, swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
            layer_types=(FULL,) * cfg.num_layers, mlp_layer_types=("dense",) * cfg.num_layers, rope_yarn=None)
        self.fc = ReplicatedLinear(len(cfg.target_layer_ids) * target_cfg.hidden_size, H, dtype)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.final_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        self.layers = nn.ModuleList(DSparkLayer(self.layer_cfg, tp, dtype) for _ in range(cfg.num_layers))
        self.markov_w1 = attach_loader(make_param((cfg.vocab_size, cfg.markov_rank), dtype),
                                       replicated_loader, [None])
        self.markov_w2 = ParallelLMHead(cfg.vocab_size, cfg.markov_rank, head_tp, dtype)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.kv_caches: list[torch.Tensor] = []    # per layer [2, num_blocks, block_size, G_local, D]

    def pack_(self) -> None:
        """MXFP8 projections: the seven linears of every layer hold codes and block scales."""
        from m3serve.layers.packed import MXFP8, pack_param_, split_note

        for l, layer in enumerate(self.layers):
            for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                        layer.mlp.down_proj):
                pack_param_(mod, "weight", MXFP8, f"DSpark layer {l}", split_note(mod, "weight"))

    # ------------------------------------------------------------ forward pieces

    def _qkv(self, layer: DSparkLayer, x: torch.Tensor):
        T, D = x.shape[0], self.cfg.head_dim
        parts = layer.self_attn.qkv_proj(x)
        return (parts[0].view(T, self.num_heads, D), parts[1].view(T, self.num_kv_heads, D),
                parts[2].view(T, self.num_kv_heads, D))

    def _write(self, l: int, q, k, v, cos, sin, slots) -> torch.Tensor:
        """q/k Gemma norms + RoPE, K/V into layer l's cache at `slots` -> the normed, rotated q."""
        attn, cache, eps = self.layers[l].self_attn, self.kv_caches[l], self.cfg.rms_norm_eps
        if use_triton("attention", q):
            from m3serve.kernels.qk_norm_rope import qk_norm_rope_cache
            q, _ = qk_norm_rope_cache(q, k, v, None, None, attn.q_norm.weight, attn.k_norm.weight, None, None,
                                      cos, sin, cache, None, slots, eps)
            return q
        q = apply_rotary(gemma_rms_norm(q, attn.q_norm.weight, eps), cos, sin)
        k = apply_rotary(gemma_rms_norm(k, attn.k_norm.weight, eps), cos, sin)
        write_cache_ref(cache[0], k, slots)
        write_cache_ref(cache[1], v, slots)
        return q

    def write_context(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """taps [T, n x H] at positions [T] -> every layer's context K/V at `slots` [T]."""
        main = self.hidden_norm(self.fc(taps))
        cos, sin = self.rotary.cos_sin(positions, main.dtype)
        for l, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, main)
            self._write(l, q, k, v, cos, sin, slots)

    def query_block(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    meta: AttentionMetadata, key_lo: torch.Tensor, window_blocks: torch.Tensor | None):
        """embeds [R*k, H] of the query blocks at positions [R*k] (their K/V go to `slots`);
        `meta` makes every query its own sequence ending at its block's last position (so it
        sees the whole block), `key_lo` [R*k] its window's first key; `window_blocks`
        [R*k, G, n] the window's logical blocks (the GPU kernel reads only those) -> the
        final-normed hidden states [R*k, H]."""
        x = embeds
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        T, D = x.shape[0], self.cfg.head_dim
        for l, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x))
            q = self._write(l, q, k, v, cos, sin, slots)
            o = self._attend(l, q, meta, key_lo, window_blocks)
            x = x + layer.self_attn.o_proj(o.reshape(T, self.num_heads * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.final_norm(x)

    def _attend(self, l: int, q, meta: AttentionMetadata, key_lo, window_blocks) -> torch.Tensor:
        cache = self.kv_caches[l]
        if use_triton("attention", q):
            from m3serve.kernels.paged_attention import paged_attention
            return paged_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
                                   block_ids=window_blocks, max_query_len=1, max_seq_len=meta.max_seq_len,
                                   key_lo=key_lo)
        return paged_attention_ref(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
                                   max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, key_lo=key_lo)

    def markov(self, base_local: torch.Tensor, anchor: torch.Tensor, target_head) -> torch.Tensor:
        """base_local [R, k, V_local] (this rank's vocabulary slice of the target head's logits),
        anchor [R] -> greedy drafts [R, k], each biased by the previous token."""
        prev, drafts = anchor, []
        for i in range(base_local.shape[1]):
            e = self.markov_w1[prev]                                          # [R, r]
            local = base_local[:, i] + self.markov_w2.local_logits(e)
            prev = target_head.greedy(local)
            drafts.append(prev)
        return torch.stack(drafts, dim=1)


class DSparkDrafter(Drafter):
    """DSpark as a draft kind: one cache group ("dspark": every draft layer's K/V) in its own
    window pool, the target's taps in, all k drafts from one block pass (`steps` returns them)."""

    def __init__(self, draft: DSparkDraft, target, device: torch.device, k: int):
        super().__init__(draft, target, device)
        self.taps, self.k = draft.cfg.taps, k
        self.block_size = target.cfg.index_block_size
        cfg = draft.cfg
        self.sliding_window = cfg.sliding_window
        self.noise = cfg.noise_token_id
        # the window's logical blocks for a query block ending at position e: blocks of
        # [e - k + 1 - (W - 1), e], at most this many
        self.window_blocks = (cfg.sliding_window + k - 2) // self.block_size + 2

    def cache_specs(self, kv_bytes: int, index_bytes: int) -> list[CacheGroupSpec]:
        d = self.draft
        kv_bytes = d.dtype.itemsize if kv_bytes == 1 else kv_bytes      # never fp8 (allocate_caches)
        return [CacheGroupSpec("dspark", tuple(range(d.cfg.num_layers)),
                               2 * d.num_kv_heads * d.cfg.head_dim * kv_bytes)]

    def cache_planes(self) -> list[tuple[str, torch.Tensor]]:
        return []          # its own pool: the CPU tier and KV transfer carry none of it

    def attention_kernels(self):
        return [(self.draft.num_heads, self.draft.kv_caches[0], True, True, None, None)]   # window + edge

    def allocate_caches(self, num_blocks: int, block_size: int, kv_dtype, index_dtype) -> None:
        d = self.draft
        # the draft's K/V stay in the model dtype (an fp8 cache would need scales of its own)
        dtype = d.dtype if kv_dtype == torch.float8_e4m3fn else kv_dtype
        d.kv_caches = [torch.zeros(2, num_blocks, block_size, d.num_kv_heads, d.cfg.head_dim, dtype=dtype,
                                   device=self.device) for _ in range(d.cfg.num_layers)]

    def first(self, next_ids, hidden, positions, meta, last_index, next_media=None, context_rows=None):
        """Write the step's context K/V -> (anchor ids [R]: the token after each request's last
        verified position, no state); with `context_rows` [T'], of those rows only (the others
        would go to the null block: no later query reads them). Images reach the draft through
        the taps (the target's streams over its merged input); `next_media` is not read: an
        anchor that is a placeholder only ends a partial prompt chunk, whose drafts are
        discarded."""
        if context_rows is None:
            self.draft.write_context(hidden, positions, meta.slot_mapping)
        else:
            self.draft.write_context(hidden[context_rows], positions[context_rows],
                                     meta.slot_mapping[context_rows])
        return next_ids[last_index], None

    def steps(self, anchor, state, last_pos, block_tables, cpu_positions, k, decode_meta,
              valid_from=None) -> torch.Tensor:
        """The query block of every request -> drafts [R, k]. anchor [R] int64, last_pos [R]
        (the last verified position), block_tables [R, W] (the draft's own), valid_from [R] (no
        key below it is read: holes); `cpu_positions` (the last positions on the host) bound
        the reference op; None (CUDA graphs) runs to the table's end."""
        d, bs, R = self.draft, self.block_size, anchor.shape[0]
        dev = anchor.device
        offs = torch.arange(1, k + 1, device=dev)
        pos = (last_pos[:, None] + offs[None, :]).reshape(-1)                  # [R*k]
        tables = block_tables.repeat_interleave(k, dim=0)                      # [R*k, W]
        slots = tables[torch.arange(R * k, device=dev), pos // bs].long() * bs + pos % bs
        ends = (last_pos + k + 1).to(torch.int32)                              # block end + 1 per request
        seq_lens = ends.repeat_interleave(k)
        key_lo = (pos - (d.cfg.sliding_window - 1)).clamp_min(0)
        if valid_from is not None:
            key_lo = torch.maximum(key_lo, valid_from.long().repeat_interleave(k))
        window = None
        if use_triton("attention", anchor):
            first = key_lo // bs                                               # [R*k]
            ids = first[:, None] + torch.arange(self.window_blocks, device=dev)[None, :]
            ids = torch.where(ids * bs < seq_lens[:, None].long(), ids, -1)
            window = ids[:, None, :].expand(-1, d.num_kv_heads, -1).contiguous()
        if cpu_positions is not None:
            seq_cpu = [p + k + 1 for p in cpu_positions for _ in range(k)]
            max_seq = max(seq_cpu, default=1)
        else:
            seq_cpu, max_seq = [1] * (R * k), tables.shape[1] * bs
        meta = AttentionMetadata(
            query_start_loc=torch.arange(R * k + 1, dtype=torch.int32, device=dev), seq_lens=seq_lens,
            block_tables=tables, slot_mapping=slots, query_start_loc_cpu=list(range(R * k + 1)),
            seq_lens_cpu=seq_cpu, block_size=bs, max_query_len=1, max_seq_len=max_seq)
        ids = torch.full((R, k), self.noise, dtype=torch.int64, device=dev)
        ids[:, 0] = anchor
        h = d.query_block(self.embed(ids.reshape(-1)), pos, slots, meta, key_lo, window)
        base = self.target.lm_head.local_logits(h).view(R, k, -1)
        return d.markov(base, anchor, self.target.lm_head)


# ---------------------------------------------------------------- checkpoint

def dspark_shapes(cfg: DSparkConfig, target_hidden: int) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names (the checkpoint's, without the `language_model.model.dspark.`
    prefix) and their full shapes; projections' `weight_scale_inv` with MXFP8."""
    H, D, F, r = cfg.hidden_size, cfg.head_dim, cfg.ffn_size, cfg.markov_rank
    shapes = {"fc.weight": (H, len(cfg.target_layer_ids) * target_hidden), "hidden_norm.weight": (H,),
              "final_norm.weight": (H,), "markov_head.markov_w1.weight": (cfg.vocab_size, r),
              "markov_head.markov_w2.weight": (cfg.vocab_size, r)}
    if cfg.confidence_head:
        shapes.update({"confidence_head.proj.weight": (1, H + r), "confidence_head.proj.bias": (1,)})
    proj = {"self_attn.q_proj": (cfg.num_attention_heads * D, H), "self_attn.k_proj": (cfg.num_key_value_heads * D, H),
            "self_attn.v_proj": (cfg.num_key_value_heads * D, H), "self_attn.o_proj": (H, cfg.num_attention_heads * D),
            "mlp.gate_proj": (F, H), "mlp.up_proj": (F, H), "mlp.down_proj": (H, F)}
    for l in range(cfg.num_layers):
        p = f"layers.{l}.decoder_layer."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
        for name, (n, kk) in proj.items():
            shapes[p + name + ".weight"] = (n, kk)
            if cfg.quant == "mxfp8":
                shapes[p + name + ".weight_scale_inv"] = (n, kk // 32)
    return shapes


def dspark_dtypes(cfg: DSparkConfig) -> dict[str, tuple[torch.dtype, ...]]:
    """Required dtypes of the packed projections' codes and scales."""
    if cfg.quant != "mxfp8":
        return {}
    out = {}
    for l in range(cfg.num_layers):
        for name in _LAYER_PARAMS:           # the seven projections of a layer
            p = f"layers.{l}.decoder_layer.{name}."
            out[p + "weight"] = (torch.float8_e4m3fn,)
            out[p + "weight_scale_inv"] = (torch.uint8, torch.float8_e8m0fnu)
    return out


def canonical_dspark_name(key: str) -> str:
    """A checkpoint key -> its canonical name (the prefix dropped; other keys stay as they are
    and are then reported as unexpected)."""
    return key[len(PREFIX):] if key.startswith(PREFIX) else key


_LAYER_PARAMS = {"self_attn.q_proj": ("self_attn.qkv_proj", "q"), "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
                 "self_attn.v_proj": ("self_attn.qkv_proj", "v"), "self_attn.o_proj": ("self_attn.o_proj", None),
                 "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
                 "mlp.down_proj": ("mlp.down_proj", None)}


def dspark_to_param(name: str) -> tuple[str | None, object]:
    """Canonical name -> (parameter of `DSparkDraft`, shard id); None: checked, not kept."""
    if name.startswith("confidence_head."):
        return None, None
    if name == "markov_head.markov_w1.weight":
        return "markov_w1", None
    if name == "markov_head.markov_w2.weight":
        return "markov_w2.weight", None
    if name.startswith("layers."):
        _, l, _, rest = name.split(".", 3)                   # layers.{l}.decoder_layer.{rest}
        module, _, part = rest.rpartition(".")
        if module in _LAYER_PARAMS:
            target, shard = _LAYER_PARAMS[module]
            suffix = "weight_block_scale" if part == "weight_scale_inv" else part
            return f"layers.{l}.{target}.{suffix}", shard
        return f"layers.{l}.{rest}", None
    return name, None
