"""Where a model's files are, without torch: the checkpoint directory of a model name (local
directory, Hugging Face hub id, or None for the embedded tiny model) and its tokenizer.

The API process uses only this module of `model/`, so it never imports torch. The embedded tiny
model is a trained checkpoint shipped in the package (`model/tiny_trained/`, made by
`scripts/train_tiny.py`); the random one is `make-tiny`'s.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

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


TRAINED_TINY_DIR = Path(__file__).resolve().parent / "tiny_trained"


def default_model_dir() -> Path:
    """The embedded tiny model: the trained checkpoint in the package, with its drafts
    (`dspark/`, `eagle3/`, bundled MTP)."""
    if not (TRAINED_TINY_DIR / "model.safetensors").is_file():
        raise ValueError(f"the embedded tiny model is missing ({TRAINED_TINY_DIR}/model.safetensors): "
                         f"reinstall m3serve, or rebuild it with scripts/train_tiny.py")
    return TRAINED_TINY_DIR


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
