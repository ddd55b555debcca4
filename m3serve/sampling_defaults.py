"""Request sampling defaults from the checkpoint, as vLLM applies them: the sampling values of
the model's `generation_config.json` (or another directory's, or none: `--generation-config`),
with `--override-generation-config` laid over them, are the defaults of every request that
does not set them. A request's own values always win. No torch here (the API process uses it).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from m3serve.config import GENERATION_KEYS, GenerationConfig
from m3serve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _read(directory: Path) -> dict:
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return data


def load_sampling_defaults(config: GenerationConfig, model_dir) -> dict:
    """SamplingParams keywords (`temperature`, ..., `max_tokens`) that requests default to."""
    mode = config.generation_config
    if mode == "vllm":
        source = {}
    elif mode == "auto":
        source = _read(Path(model_dir))
    else:
        directory = Path(mode)
        if not directory.is_dir():
            raise ValueError(f"--generation-config {mode!r}: not auto, vllm, or a directory")
        if not (directory / "generation_config.json").is_file():
            raise ValueError(f"--generation-config {mode!r}: the directory has no generation_config.json")
        source = _read(directory)
    unused = sorted(k for k in config.overrides if k not in GENERATION_KEYS)
    if unused:
        logger.info("--override-generation-config: %s not applicable (used: %s)", unused, list(GENERATION_KEYS))
    merged = {**{k: source[k] for k in GENERATION_KEYS if source.get(k) is not None},
              **{k: v for k, v in config.overrides.items() if k in GENERATION_KEYS}}
    defaults = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in merged.items()}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"generation config defaults {defaults}: {e}") from None
    return defaults


def describe(defaults: dict) -> str:
    if not defaults:
        return "request sampling defaults: the OpenAI API's (temperature 1, no top-p/top-k limit)"
    return ("request sampling defaults from the generation config (a request's own values win; "
            f"--generation-config vllm turns them off): {defaults}")
