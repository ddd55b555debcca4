"""A checkpoint's files as tensors: which safetensors files it has, each tensor read lazily and
one at a time, and the mapping of either naming scheme (the original MiniMax-M3 names, or the
ones transformers' `save_pretrained` writes: fused gate_up, stacked experts,
`self_attn.indexer.*`) to one canonical name per tensor. The loader, the quantised layouts and
the draft loaders all read checkpoints through here."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

_SKIP = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.|(^|\.)mtp\.")
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

def canonicalize(name: str, tensor) -> list[tuple[str, object]] | None:
    """Map one checkpoint tensor (either naming) to canonical (name, tensor) pairs; None = skip.

    `tensor` may be a `LazyTensor`: it is read only where transformers' fused/stacked tensors
    must be split (into views, never copies); plain names pass it on unread.
    """
    if _SKIP.search(name) or name.startswith(("vision_tower.", "multi_modal_projector.")):
        return None
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    elif name.startswith("language_model.model."):
        name = "model." + name[len("language_model.model."):]
    elif name.startswith("language_model.lm_head."):
        name = "lm_head." + name[len("language_model.lm_head."):]
    m = LAYER_NAME.match(name)
    if not m:
        return [(name, tensor)]
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    moe = p + "block_sparse_moe."
    if rest.startswith("self_attn.indexer."):
        sub = rest[len("self_attn.indexer."):]
        return [(p + "self_attn.index_" + sub, tensor)]
    if rest == "mlp.gate_up_proj.weight":
        gate, up = materialize(tensor).chunk(2, dim=0)
        return [(p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up)]
    if rest == "mlp.shared_experts.gate_up_proj.weight":
        gate, up = materialize(tensor).chunk(2, dim=0)
        return [(moe + "shared_experts.gate_proj.weight", gate), (moe + "shared_experts.up_proj.weight", up)]
    if rest == "mlp.experts.gate_up_proj":                  # [E, 2I, H]
        tensor, out = materialize(tensor), []
        for e in range(tensor.shape[0]):
            w1, w3 = tensor[e].chunk(2, dim=0)
            out += [(f"{moe}experts.{e}.w1.weight", w1), (f"{moe}experts.{e}.w3.weight", w3)]
        return out
    if rest == "mlp.experts.down_proj":                     # [E, H, I]
        tensor = materialize(tensor)
        return [(f"{moe}experts.{e}.w2.weight", tensor[e]) for e in range(tensor.shape[0])]
    if rest == "mlp.gate.e_score_correction_bias":
        return [(moe + "e_score_correction_bias", tensor)]
    if rest.startswith(("mlp.gate.", "mlp.shared_experts.")):
        return [(moe + rest[len("mlp."):], tensor)]
    return [(name, tensor)]




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


class LazyTensor:
    """A tensor known by its shape (and dtype, when the file says), read (or made) only when
    `load()` is called."""

    def __init__(self, shape: tuple[int, ...], load, dtype: torch.dtype | None = None):
        self.shape, self._load, self.dtype = tuple(shape), load, dtype

    def load(self) -> torch.Tensor:
        return self._load()


def materialize(t) -> torch.Tensor:
    return t.load() if isinstance(t, LazyTensor) else t


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
              "F8_E8M0": torch.float8_e8m0fnu}


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[Path, str, LazyTensor]]:
    """Yield (file, tensor name, lazy tensor) one tensor at a time, valid until the next one;
    read errors name the file and the tensor."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in list(f.keys()):
                    def read(f=f, key=key, path=path):
                        try:
                            return f.get_tensor(key)
                        except Exception as e:
                            raise ValueError(f"corrupt safetensors file {path}: cannot read tensor "
                                             f"{key!r} ({e})") from None
                    info = f.get_slice(key)
                    yield path, key, LazyTensor(info.get_shape(), read, _ST_DTYPES.get(info.get_dtype()))
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"corrupt safetensors file {path}: {e}") from None
