"""MiniMax-M3 model configuration: parse a checkpoint's `config.json` into `M3Config`.

Accepts the top-level `minimax_m3_vl` config (with `text_config`, `vision_config` kept as a raw
dict) or a bare text config, in either the checkpoint's legacy names (`sparse_attention_config`,
`moe_layer_freq`) or transformers' flat names (`index_*`, `layer_types`, `mlp_layer_types`).
Unsupported values raise `ValueError` naming the field and the value.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from m3serve.model.flavor import M31_FLASH, check_m31_flash, flavor_of

SPARSE = "minimax_m3_sparse"
FULL = "full_attention"

# legacy sparse_attention_config key -> flat field
_LEGACY_SPARSE = {
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
    "sparse_init_block": "index_init_blocks",
}

# cross-layer top-k reuse: text-model keys that must sit in text_config (vLLM's ROCm path refuses
# them at the top level too)
INDEX_REUSE_KEYS = ("use_index_cache", "index_topk_freq", "index_skip_topk_offset")

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "vocab_size")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's parameters (rope_type "yarn"): positions interpolated by `factor` on the low
    frequencies, kept on the high ones, with a linear ramp between the dimensions that turn
    `beta_fast` and `beta_slow` times over `original_max_position_embeddings`; cos/sin scaled
    by `attention_factor` (default 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def to_dict(self) -> dict:
        return {"rope_type": "yarn", "factor": self.factor, "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow, "attention_factor": self.attention_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "truncate": self.truncate}


@dataclass(frozen=True)
class M3Config:
    """The text backbone's hyper-parameters (names follow transformers' flat config)."""
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int            # routed expert width
    dense_intermediate_size: int
    shared_intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int                   # = head_dim * partial_rotary_factor
    max_position_embeddings: int
    swiglu_alpha: float
    swiglu_limit: float
    index_n_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int
    index_init_blocks: int
    layer_types: tuple[str, ...]      # FULL | SPARSE per layer
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per layer
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    vision_config: dict | None = field(default=None, compare=False)
    # the VL wrapper's placeholder ids and projector width (None in a bare text config)
    image_token_id: int | None = field(default=None, compare=False)
    video_token_id: int | None = field(default=None, compare=False)
    projector_hidden_size: int | None = field(default=None, compare=False)
    # YaRN context extension (rope_type "yarn", e.g. through --hf-overrides); None = plain RoPE
    rope_yarn: YarnScaling | None = None
    # (rank, size): this one-GPU model is one rank's view of expert parallelism over `size`
    # ranks (`bench make-realshape --tp-rank N --ep`): it holds experts [rank * E / size, ...)
    # and computes only the rows routed to them, with no collectives; None = a whole model
    expert_view: tuple[int, int] | None = None
    # "m3" or "m3.1-flash" (MSA in every layer): see model/flavor.py
    flavor: str = "m3"
    # cross-layer top-k reuse (opt-in, text_config `use_index_cache`): one sparse layer in
    # `index_topk_freq` runs the indexer, the others reuse its block selection (`index_source`);
    # 1 = every sparse layer runs its own (the trained model)
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 0

    @property
    def sparse_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == SPARSE]

    @property
    def index_layer_ids(self) -> list[int]:
        """The sparse layers that run the indexer: they hold the index projections, norms and
        an index cache. Every sparse layer unless cross-layer top-k reuse is on."""
        return [i for i in self.sparse_layer_ids if self.computes_index(i)]

    def computes_index(self, layer_id: int) -> bool:
        """Whether sparse layer `layer_id` runs its indexer: with ordinal n among the sparse
        layers, iff max(n - index_skip_topk_offset, 0) is a multiple of index_topk_freq (so the
        first sparse layer always does). False for a dense layer."""
        if not self.is_sparse(layer_id):
            return False
        if self.index_topk_freq == 1:
            return True
        n = self.sparse_layer_ids.index(layer_id)
        return max(n - self.index_skip_topk_offset, 0) % self.index_topk_freq == 0

    def index_source(self, layer_id: int) -> int:
        """The layer whose block selection sparse layer `layer_id` attends with: itself when it
        runs the indexer, else the latest sparse layer before it that does."""
        return max(i for i in self.sparse_layer_ids if i <= layer_id and self.computes_index(i))

    def is_sparse(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == SPARSE

    def is_moe(self, layer_id: int) -> bool:
        return self.mlp_layer_types[layer_id] == "sparse"

    def to_hf_text_dict(self) -> dict:
        """transformers' flat text-config dict for this config (used to build reference models)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in ("rope_theta", "rotary_dim", "index_init_blocks", "torch_dtype",
                               "vision_config", "layer_types", "mlp_layer_types", "rope_yarn",
                               "image_token_id", "video_token_id", "projector_hidden_size",
                               "expert_view", "flavor", "index_topk_freq", "index_skip_topk_offset")}
        d["layer_types"] = list(self.layer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.rotary_dim / self.head_dim}
        if self.rope_yarn is not None:
            d["rope_parameters"].update(self.rope_yarn.to_dict())
        return d


def _yarn(given: dict, max_position_embeddings: int) -> YarnScaling:
    """YarnScaling from a rope_type "yarn" dict (transformers' and vLLM's keys)."""
    def number(key, default=None):
        value = given.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise _bad(f"rope_scaling.{key}", value, "must be a positive number")
        return float(value)

    original = number("original_max_position_embeddings")
    factor = number("factor")
    if original is None and factor is None:
        raise _bad("rope_scaling", given, "yarn needs factor and/or original_max_position_embeddings")
    if factor is None:
        factor = max_position_embeddings / original
    if original is None:
        original = max_position_embeddings / factor
    attention = number("attention_factor")
    if attention is None:
        def m(scale, k=1.0):
            return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0
        mscale, mscale_all = number("mscale"), number("mscale_all_dim")
        attention = m(factor, mscale) / m(factor, mscale_all) if mscale and mscale_all else m(factor)
    return YarnScaling(factor, int(original), number("beta_fast", 32.0) or 32.0, number("beta_slow", 1.0) or 1.0,
                       attention, bool(given.get("truncate", True)))


def _bad(name: str, value, why: str) -> ValueError:
    return ValueError(f"config field {name!r}: {why} (got {value!r})")


def parse_config(raw: dict) -> M3Config:
    """Build an `M3Config` from a config.json dict (VL wrapper or bare text config)."""
    if not isinstance(raw, dict):
        raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type is not None and not str(model_type).startswith("minimax_m3"):
        archs = raw.get("architectures") or []
        raise ValueError(f"model_type {model_type!r}{f' ({archs[0]})' if archs else ''} is not MiniMax-M3: "
                         f"m3serve serves MiniMax-M3 checkpoints (model_type 'minimax_m3_vl')")
    vision = None
    text = raw
    if "text_config" in raw:
        text = raw["text_config"]
        vision = raw.get("vision_config")
        if not isinstance(text, dict):
            raise _bad("text_config", text, "must be an object")
        misplaced = [k for k in INDEX_REUSE_KEYS if k in raw]
        if misplaced:
            raise ValueError(
                f"config field {misplaced[0]!r} is at the top level of a config with a text_config; "
                f"the cross-layer top-k reuse keys {list(INDEX_REUSE_KEYS)} belong in text_config, e.g. "
                f"--hf-overrides '{{\"text_config\": {{\"use_index_cache\": true, \"index_topk_freq\": 4}}}}'")
    for name in _REQUIRED:
        if name not in text:
            raise ValueError(f"config field {name!r} is missing")
    n_layers = text["num_hidden_layers"]
    if not isinstance(n_layers, int) or n_layers <= 0:
        raise _bad("num_hidden_layers", n_layers, "must be a positive integer")
    n_heads, n_kv = text["num_attention_heads"], text["num_key_value_heads"]
    if n_kv <= 0 or n_heads % n_kv:
        raise _bad("num_key_value_heads", n_kv, f"must divide num_attention_heads={n_heads}")
    head_dim = text.get("head_dim") or text["hidden_size"] // n_heads

    act = text.get("hidden_act", "swigluoai")
    # transformers rewrites swigluoai to "silu" when it saves; both mean the same gate here.
    if act not in ("swigluoai", "silu"):
        raise _bad("hidden_act", act, "only 'swigluoai' is supported")
    if text.get("scoring_func", "sigmoid") != "sigmoid":
        raise _bad("scoring_func", text["scoring_func"], "only 'sigmoid' is supported")
    if text.get("attention_output_gate", False):
        raise _bad("attention_output_gate", True, "output gates are not supported")

    flat = {k: text[k] for k in ("index_n_heads", "index_head_dim", "index_block_size",
                                 "index_topk_blocks", "index_local_blocks") if k in text}
    flat.setdefault("index_init_blocks", 0)
    sparse_cfg = text.get("sparse_attention_config") or {}
    for legacy, name in _LEGACY_SPARSE.items():
        if legacy in sparse_cfg:
            flat[name] = sparse_cfg[legacy]
    score = sparse_cfg.get("sparse_score_type", "max")
    if score != "max":
        raise _bad("sparse_attention_config.sparse_score_type", score, "only 'max' is supported")

    layer_types = given = text.get("layer_types")
    src = "layer_types"
    if layer_types is None and "sparse_attention_freq" in sparse_cfg:
        given = sparse_cfg["sparse_attention_freq"]
        layer_types = [SPARSE if f else FULL for f in given]
        src = "sparse_attention_config.sparse_attention_freq"
    if layer_types is None:
        layer_types = [FULL] * n_layers
    if len(layer_types) != n_layers:
        raise _bad(src, given, f"needs {n_layers} entries (num_hidden_layers)")
    for t in layer_types:
        if t not in (FULL, SPARSE):
            raise _bad(src, t, f"entries must be {FULL!r} or {SPARSE!r}")

    mlp_types = given = text.get("mlp_layer_types")
    src = "mlp_layer_types"
    if mlp_types is None and "moe_layer_freq" in text:
        given = text["moe_layer_freq"]
        mlp_types = ["sparse" if f else "dense" for f in given]
        src = "moe_layer_freq"
    if mlp_types is None:
        mlp_types = ["sparse"] * n_layers
    if len(mlp_types) != n_layers:
        raise _bad(src, given, f"needs {n_layers} entries (num_hidden_layers)")
    for t in mlp_types:
        if t not in ("dense", "sparse"):
            raise _bad(src, t, "entries must be 'dense' or 'sparse'")

    disabled = sparse_cfg.get("sparse_disable_index_value")
    if disabled is not None:
        if not isinstance(disabled, list) or len(disabled) != n_layers:
            raise _bad("sparse_attention_config.sparse_disable_index_value", disabled,
                       f"needs {n_layers} entries (num_hidden_layers)")
        with_value = [i for i, t in enumerate(layer_types) if t == SPARSE and not disabled[i]]
        if with_value:
            raise _bad("sparse_attention_config.sparse_disable_index_value", disabled,
                       f"layers {with_value[:5]} are sparse with an index value projection, which "
                       f"MiniMax-M3 does not have and m3serve does not support (must be 1 for every MSA layer)")
    flavor = flavor_of([t == SPARSE for t in layer_types])
    if flavor == M31_FLASH:
        check_m31_flash(text, sparse_cfg)

    block = flat.get("index_block_size", 128)
    if not isinstance(block, int) or block <= 0 or block % 16:
        raise _bad("index_block_size (sparse_block_size)", block, "must be a positive multiple of 16")
    n_index = flat.get("index_n_heads", 4)
    if any(t == SPARSE for t in layer_types) and n_index != n_kv:
        raise _bad("index_n_heads (sparse_num_index_heads)", n_index,
                   f"must equal num_key_value_heads={n_kv}")

    # plain RoPE, or YaRN asked for by either key (rope_scaling, e.g. from --hf-overrides, wins)
    rope, yarn_source = {}, None
    for key in ("rope_parameters", "rope_scaling"):
        given = text.get(key) or {}
        if not isinstance(given, dict):
            raise _bad(key, given, "must be an object")
        kind = given.get("rope_type", given.get("type", "default"))
        if kind not in ("default", None, "yarn"):
            raise _bad(f"{key}.rope_type", kind, "only default and yarn RoPE are supported")
        if given and not rope:
            rope = given
        if kind == "yarn":
            yarn_source = given
    max_pos = int(text.get("max_position_embeddings", 4096))
    theta = rope.get("rope_theta", text.get("rope_theta", 5_000_000.0))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor"))
    rotary_dim = int(head_dim * factor) if factor is not None else text.get("rotary_dim", head_dim // 2)
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise _bad("partial_rotary_factor/rotary_dim", rotary_dim, f"must be even and <= head_dim={head_dim}")
    rope_yarn = _yarn(yarn_source, max_pos) if yarn_source is not None else None

    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    n_experts = text.get("num_local_experts", text.get("num_experts", 128))
    top_k = text.get("num_experts_per_tok", 4)
    if not 0 < top_k <= n_experts:
        raise _bad("num_experts_per_tok", top_k, f"must be in [1, num_local_experts={n_experts}]")
    expert_view = _expert_view(text.get("expert_parallel_view"), n_experts)
    index_topk_freq, index_skip_topk_offset = _index_reuse(text)
    return M3Config(
        expert_view=expert_view, flavor=flavor,
        index_topk_freq=index_topk_freq, index_skip_topk_offset=index_skip_topk_offset,
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
        intermediate_size=text.get("intermediate_size", 3072),
        dense_intermediate_size=text.get("dense_intermediate_size", 12288),
        shared_intermediate_size=text.get("shared_intermediate_size",
                                          text.get("intermediate_size", 3072) * text.get("n_shared_experts", 1)),
        num_local_experts=n_experts, num_experts_per_tok=top_k,
        routed_scaling_factor=float(text.get("routed_scaling_factor", 2.0)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        rotary_dim=rotary_dim, rope_yarn=rope_yarn,
        max_position_embeddings=int(text.get("max_position_embeddings", 524288)),
        swiglu_alpha=float(text.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(text.get("swiglu_limit", 7.0)),
        index_n_heads=n_index, index_head_dim=flat.get("index_head_dim", 128),
        index_block_size=block, index_topk_blocks=flat.get("index_topk_blocks", 16),
        index_local_blocks=flat.get("index_local_blocks", 1),
        index_init_blocks=flat.get("index_init_blocks", 0),
        layer_types=tuple(layer_types), mlp_layer_types=tuple(mlp_types),
        bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")), eos_token_id=eos,
        torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype")
                        or raw.get("dtype") or "bfloat16"),
        vision_config=vision,
        image_token_id=_optional_int(raw, "image_token_index", "image_token_id") if vision is not None else None,
        video_token_id=_optional_int(raw, "video_token_index", "video_token_id") if vision is not None else None,
        projector_hidden_size=_optional_int(raw, "projector_hidden_size") if vision is not None else None,
    )


def _index_reuse(text: dict) -> tuple[int, int]:
    """(index_topk_freq, index_skip_topk_offset) of cross-layer top-k reuse from the text
    config: (1, 0) unless `use_index_cache` is true. With it, index_topk_freq is required, an
    integer >= 1 (1 = every sparse layer runs its indexer); the offset an integer >= 0
    (default 0). The two without `use_index_cache` would do nothing, so they are refused;
    with `use_index_cache: false` they are checked and left unused."""
    use = text.get("use_index_cache")
    freq, offset = text.get("index_topk_freq"), text.get("index_skip_topk_offset")
    if use is not None and not isinstance(use, bool):
        raise _bad("use_index_cache", use, "must be true or false")
    if use is None:
        for key, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
            if value is not None:
                raise _bad(key, value, "takes effect only with use_index_cache: true "
                                       "(cross-layer top-k reuse is opt-in)")
        return 1, 0
    if use and freq is None:
        raise _bad("index_topk_freq", freq, "is required with use_index_cache: true "
                                            "(one sparse layer in index_topk_freq runs the indexer)")
    if freq is not None and (isinstance(freq, bool) or not isinstance(freq, int) or freq < 1):
        raise _bad("index_topk_freq", freq, "must be an integer >= 1 (1: every sparse layer runs its indexer)")
    if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int) or offset < 0):
        raise _bad("index_skip_topk_offset", offset, "must be an integer >= 0")
    return (freq, offset or 0) if use else (1, 0)


def _optional_int(raw: dict, *keys: str) -> int | None:
    for key in keys:
        value = raw.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise _bad(key, value, "must be an integer")
            return value
    return None


def _expert_view(view, num_experts: int) -> tuple[int, int] | None:
    """`expert_parallel_view` {"rank": r, "size": n} -> (r, n), checked."""
    if view is None:
        return None
    name = "expert_parallel_view"
    if not isinstance(view, dict) or set(view) != {"rank", "size"}:
        raise _bad(name, view, 'must be {"rank": r, "size": n}')
    rank, size = view["rank"], view["size"]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (rank, size)) or not 0 <= rank < size:
        raise _bad(name, view, "needs integers 0 <= rank < size")
    if num_experts % size:
        raise _bad(name, view, f"size must divide num_local_experts={num_experts}")
    return rank, size


def read_config_json(model_dir: str | Path, what: str = "") -> dict:
    """`<model_dir>/config.json` as a dict; a missing, malformed or non-object file is a
    ValueError naming it (`what` names the checkpoint kind in the message)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in the {what + ' ' if what else ''}directory {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a JSON object, got {type(raw).__name__}")
    return raw


def load_config(model_dir: str | Path, overrides: dict | None = None) -> M3Config:
    """Read `<model_dir>/config.json`; a missing or malformed file is a ValueError naming it.
    `overrides` (vLLM's --hf-overrides) are laid over it first: see `apply_overrides`."""
    return parse_config(apply_overrides(read_config_json(model_dir), overrides))


def apply_overrides(raw: dict, overrides: dict | None) -> dict:
    """config.json with `overrides` merged in, nested objects key by key. Keys of the text
    model may be given at the top level or under `text_config`; both land in the text config
    of a checkpoint that has one (where vLLM applies them), and at the top level of a bare text
    config. The cross-layer top-k reuse keys (`INDEX_REUSE_KEYS`) must be under text_config
    when the checkpoint has one: given at the top level, `parse_config` refuses them."""
    if not overrides:
        return raw

    def merge(base: dict, extra: dict) -> dict:
        out = dict(base)
        for key, value in extra.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    extra = dict(overrides)
    text_extra = extra.pop("text_config", {})
    if not isinstance(text_extra, dict):
        raise ValueError(f"hf_overrides.text_config must be a JSON object, got {text_extra!r}")
    if "text_config" in raw:
        # the top-level keys of the wrapper stay; so do the reuse keys, which parse_config then
        # refuses there (they must be nested under text_config, as on vLLM's ROCm path)
        top_keys = {"architectures", "model_type", "vision_config", "torch_dtype", "image_token_index",
                    "video_token_index", "projector_hidden_size", "tie_word_embeddings", *INDEX_REUSE_KEYS}
        text_extra = {**{k: v for k, v in extra.items() if k not in top_keys}, **text_extra}
        extra = {k: v for k, v in extra.items() if k in top_keys}
        if text_extra:
            extra["text_config"] = text_extra
    else:                            # a bare text config: its top level is the text config
        extra = merge(extra, text_extra)
    return merge(raw, extra)


def canonical_shapes(cfg: M3Config) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor of a checkpoint, canonical name -> full (unsharded) shape."""
    H = cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,),
              "lm_head.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_hidden_layers):
        shapes.update(layer_shapes(cfg, f"model.layers.{i}.", cfg.is_sparse(i), cfg.is_moe(i)))
    return shapes


def layer_shapes(cfg: M3Config, p: str, sparse: bool, moe: bool) -> dict[str, tuple[int, ...]]:
    """The tensors of one decoder layer under prefix `p` (canonical names, full shapes)."""
    H, D = cfg.hidden_size, cfg.head_dim
    shapes = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    a = p + "self_attn."
    shapes[a + "q_proj.weight"] = (cfg.num_attention_heads * D, H)
    shapes[a + "k_proj.weight"] = (cfg.num_key_value_heads * D, H)
    shapes[a + "v_proj.weight"] = (cfg.num_key_value_heads * D, H)
    shapes[a + "o_proj.weight"] = (H, cfg.num_attention_heads * D)
    shapes[a + "q_norm.weight"] = (D,)
    shapes[a + "k_norm.weight"] = (D,)
    if sparse:
        Di = cfg.index_head_dim
        shapes[a + "index_q_proj.weight"] = (cfg.index_n_heads * Di, H)
        shapes[a + "index_k_proj.weight"] = (Di, H)
        shapes[a + "index_q_norm.weight"] = (Di,)
        shapes[a + "index_k_norm.weight"] = (Di,)
    if moe:
        m, I, S = p + "block_sparse_moe.", cfg.intermediate_size, cfg.shared_intermediate_size
        shapes[m + "gate.weight"] = (cfg.num_local_experts, H)
        shapes[m + "e_score_correction_bias"] = (cfg.num_local_experts,)
        shapes[m + "shared_experts.gate_proj.weight"] = (S, H)
        shapes[m + "shared_experts.up_proj.weight"] = (S, H)
        shapes[m + "shared_experts.down_proj.weight"] = (H, S)
        for e in range(cfg.num_local_experts):
            shapes[f"{m}experts.{e}.w1.weight"] = (I, H)
            shapes[f"{m}experts.{e}.w3.weight"] = (I, H)
            shapes[f"{m}experts.{e}.w2.weight"] = (H, I)
    else:
        Id = cfg.dense_intermediate_size
        shapes[p + "mlp.gate_proj.weight"] = (Id, H)
        shapes[p + "mlp.up_proj.weight"] = (Id, H)
        shapes[p + "mlp.down_proj.weight"] = (H, Id)
    return shapes
