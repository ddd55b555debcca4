"""Checkpoint loading: resolve a model directory (local or Hugging Face hub), stream its
safetensors tensor by tensor into this rank's shards of a freshly built model.

Two name schemes are accepted and brought to one canonical form (the original checkpoint names
without the `language_model.` prefix): the original MiniMax-M3 names and the names transformers'
`save_pretrained` writes (fused gate_up, stacked experts, `self_attn.indexer.*`). Vision, projector
and MTP tensors are skipped. Any missing, unexpected, duplicated or mis-shaped tensor, or an
unreadable file, raises a ValueError naming the tensor and the file; the half-built model is dropped.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from m3serve.distributed import TPInfo
from m3serve.model.config import M3Config, load_config

logger = logging.getLogger(__name__)

_SKIP = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.|(^|\.)mtp\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "half": torch.float16}


def resolve_model_dir(model: str | Path) -> Path:
    """A local directory as is; otherwise a hub repo id downloaded with huggingface_hub."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model path {model} is not a directory")
    if str(model).startswith((".", "/", "~")) or str(model).count("/") != 1:
        raise ValueError(f"model {model!r}: no such directory, and not a hub repo id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(
            str(model), allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))
    except Exception as e:  # network, auth, missing repo: all one message for the user
        raise ValueError(f"model {model!r}: not a local directory and the hub download failed: {e}") from e


def canonical_shapes(cfg: M3Config) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor of a checkpoint, canonical name -> full (unsharded) shape."""
    H, D = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,),
              "lm_head.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        a = p + "self_attn."
        shapes[a + "q_proj.weight"] = (cfg.num_attention_heads * D, H)
        shapes[a + "k_proj.weight"] = (cfg.num_key_value_heads * D, H)
        shapes[a + "v_proj.weight"] = (cfg.num_key_value_heads * D, H)
        shapes[a + "o_proj.weight"] = (H, cfg.num_attention_heads * D)
        shapes[a + "q_norm.weight"] = (D,)
        shapes[a + "k_norm.weight"] = (D,)
        if cfg.is_sparse(i):
            Di = cfg.index_head_dim
            shapes[a + "index_q_proj.weight"] = (cfg.index_n_heads * Di, H)
            shapes[a + "index_k_proj.weight"] = (Di, H)
            shapes[a + "index_q_norm.weight"] = (Di,)
            shapes[a + "index_k_norm.weight"] = (Di,)
        if cfg.is_moe(i):
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


def canonicalize(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """Map one checkpoint tensor (either naming) to canonical (name, tensor) pairs; None = skip.

    transformers' fused/stacked tensors are split into views, never copied.
    """
    if _SKIP.search(name) or name.startswith(("vision_tower.", "multi_modal_projector.")):
        return None
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    elif name.startswith("language_model.model."):
        name = "model." + name[len("language_model.model."):]
    elif name.startswith("language_model.lm_head."):
        name = "lm_head." + name[len("language_model.lm_head."):]
    m = _LAYER.match(name)
    if not m:
        return [(name, tensor)]
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    moe = p + "block_sparse_moe."
    if rest.startswith("self_attn.indexer."):
        sub = rest[len("self_attn.indexer."):]
        return [(p + "self_attn.index_" + sub, tensor)]
    if rest == "mlp.gate_up_proj.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up)]
    if rest == "mlp.shared_experts.gate_up_proj.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(moe + "shared_experts.gate_proj.weight", gate), (moe + "shared_experts.up_proj.weight", up)]
    if rest == "mlp.experts.gate_up_proj":                  # [E, 2I, H]
        out = []
        for e in range(tensor.shape[0]):
            w1, w3 = tensor[e].chunk(2, dim=0)
            out += [(f"{moe}experts.{e}.w1.weight", w1), (f"{moe}experts.{e}.w3.weight", w3)]
        return out
    if rest == "mlp.experts.down_proj":                     # [E, H, I]
        return [(f"{moe}experts.{e}.w2.weight", tensor[e]) for e in range(tensor.shape[0])]
    if rest == "mlp.gate.e_score_correction_bias":
        return [(moe + "e_score_correction_bias", tensor)]
    if rest.startswith(("mlp.gate.", "mlp.shared_experts.")):
        return [(moe + rest[len("mlp."):], tensor)]
    return [(name, tensor)]


_ATTN_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "index_q_proj": "index_q",
             "index_k_proj": "index_k"}
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def canonical_to_param(name: str) -> tuple[str, object]:
    """Canonical checkpoint name -> (serving-model parameter name, shard id)."""
    m = _LAYER.match(name)
    if not m:
        return name, None
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest.startswith("self_attn."):
        sub = rest[len("self_attn."):-len(".weight")]
        if sub in _ATTN_QKV:
            return p + "self_attn.qkv_proj.weight", _ATTN_QKV[sub]
        if sub in ("index_q_norm", "index_k_norm"):
            return p + f"self_attn.indexer.{sub[len('index_'):]}.weight", None
        return name, None
    e = _EXPERT.match(rest)
    if e:
        kind = e.group(2)
        return p + ("mlp.experts.w2" if kind == "w2" else "mlp.experts.w13"), (kind, int(e.group(1)))
    for mlp in ("mlp.", "block_sparse_moe.shared_experts."):
        base = p + ("mlp." if mlp == "mlp." else "mlp.shared_experts.")
        if rest == mlp + "gate_proj.weight":
            return base + "gate_up_proj.weight", 0
        if rest == mlp + "up_proj.weight":
            return base + "gate_up_proj.weight", 1
        if rest == mlp + "down_proj.weight":
            return base + "down_proj.weight", None
    if rest == "block_sparse_moe.gate.weight":
        return p + "mlp.gate.weight", None
    if rest == "block_sparse_moe.e_score_correction_bias":
        return p + "mlp.gate.e_score_correction_bias", None
    return name, None


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (from the index when there is one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: unreadable safetensors index ({e!r})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{index} lists {f.name}, which does not exist")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yield (file, tensor name, tensor) one tensor at a time; read errors name the file."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
                for key in keys:
                    try:
                        tensor = f.get_tensor(key)
                    except Exception as e:
                        raise ValueError(f"corrupt safetensors file {path}: cannot read tensor {key!r} ({e})") from None
                    yield path, key, tensor
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"corrupt safetensors file {path}: {e}") from None


def resolve_dtype(dtype: str | torch.dtype, cfg: M3Config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = cfg.torch_dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unsupported value {dtype!r} (auto, bfloat16, float32)")
    return DTYPES[dtype]


def load_weights(model: torch.nn.Module, cfg: M3Config, model_dir: Path, progress: bool = True) -> None:
    """Stream every checkpoint tensor into `model`'s parameters (this rank's shards only)."""
    params = dict(model.named_parameters())
    expected = canonical_shapes(cfg)
    seen: dict[str, Path] = {}
    loaded: dict[str, set] = {name: set() for name in params}
    files = weight_files(model_dir)
    bar = tqdm(desc="Loading weights", unit="tensor", disable=not progress)
    for path, key, tensor in iter_checkpoint(files):
        pairs = canonicalize(key, tensor)
        if pairs is None:
            continue
        for cname, t in pairs:
            where = f"tensor {key!r} in {path.name}" + (f" (as {cname})" if cname != key else "")
            if cname not in expected:
                raise ValueError(f"unexpected {where}: not part of this model's configuration")
            if cname in seen:
                raise ValueError(f"duplicate {where}: already read from {seen[cname].name}")
            if tuple(t.shape) != expected[cname]:
                raise ValueError(f"wrong shape for {where}: {tuple(t.shape)}, expected {expected[cname]}")
            seen[cname] = path
            pname, shard = canonical_to_param(cname)
            param = params[pname]
            if shard not in param.required_shards:
                continue  # another rank's expert
            try:
                param.weight_loader(param, t, shard)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            loaded[pname].add(shard)
        bar.update(1)
    bar.close()
    missing = sorted(set(expected) - set(seen))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {model_dir} is missing tensor(s) {missing[:5]}{more}")
    for name, param in params.items():
        if set(param.required_shards) - loaded[name]:
            raise ValueError(f"parameter {name} was not fully loaded from {model_dir}")


def load_model(model: str | Path, dtype: str | torch.dtype = "auto", tp: TPInfo = TPInfo(),
               device: str | torch.device = "cpu", progress: bool = True, load_format: str = "auto",
               seed: int = 0, quantization: str | None = None):
    """Build this rank's `MiniMaxM3ForCausalLM` and load its weights. Returns (model, cfg, dir).

    load_format "dummy" reads only config.json and fills random weights on the device."""
    from m3serve.model.minimax_m3 import MiniMaxM3ForCausalLM

    model_dir = resolve_model_dir(model)
    cfg = load_config(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg)
    with torch.device(device):
        net = MiniMaxM3ForCausalLM(cfg, tp, torch_dtype)
    if load_format == "dummy":
        from m3serve.model.dummy import init_dummy_weights
        init_dummy_weights(net, seed)
    else:
        load_weights(net, cfg, model_dir, progress=progress)
    if quantization in ("fp8", "fp8_per_channel"):
        from m3serve.layers.quant import quantize_model_fp8
        quantize_model_fp8(net)
    return net.eval(), cfg, model_dir
