"""Where a model's files are, without torch: the checkpoint directory of a model name (local
directory, Hugging Face hub id, or None for the embedded tiny model) and its tokenizer.

The API process uses only this module of `model/`, so it never imports torch for a real
checkpoint; building the tiny model on first use is the one place that does.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tokenizers import Tokenizer

from m3serve import envs

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


def resolve_model_dir(model: str | Path, config_only: bool = False) -> Path:
    """A local directory as is; otherwise a hub repo id downloaded with huggingface_hub
    (`config_only`: config.json alone, for tools that never read weights)."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model path {model} is not a directory")
    if str(model).startswith((".", "/", "~")) or str(model).count("/") != 1:
        raise ValueError(f"model {model!r}: no such directory, and not a hub repo id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        patterns = ["config.json"] if config_only else _HUB_PATTERNS
        return Path(snapshot_download(str(model), allow_patterns=patterns))
    except Exception as e:  # network, auth, missing repo: all one message for the user
        raise ValueError(f"model {model!r}: not a local directory and the hub download failed: {e}") from e


# The files that define the embedded tiny model's bytes (tests/unit/test_tiny_model.py pins them).
_TINY_INPUTS = ("model/tiny.py", "model/config.py", "model/tokenizer_build.py", "model/tiny_tokenizer.json",
                "model/chat_template.jinja")


def tiny_model_cache_dir(seed: int = 0) -> Path:
    """Where the embedded tiny model lives: a cache folder keyed by the files that define it
    and the seed."""
    pkg = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in _TINY_INPUTS:
        digest.update((pkg / name).read_bytes())
    return Path(envs.CACHE_DIR) / f"tiny-{seed}-{digest.hexdigest()[:12]}"


def default_model_dir(seed: int = 0) -> Path:
    """The embedded tiny model, built on first use (the build imports torch) into its cache
    folder."""
    path = tiny_model_cache_dir(seed)
    if not (path / "model.safetensors").is_file():
        from m3serve.model.tiny import make_tiny
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny(tmp, seed)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race; its copy is identical
            pass
    return path


def model_directory(model: str | None) -> Path:
    """The checkpoint directory for `model` (None = the embedded tiny model)."""
    return default_model_dir() if model is None else resolve_model_dir(model)


def load_tokenizer(model_dir: Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json in {model_dir}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise ValueError(f"{path}: unreadable tokenizer ({e})") from None
