"""Where a speculative draft's files are: the EAGLE3 draft's folder and the DSpark draft's
config.json, given the draft named in `--speculative-config` or else the target's own eagle3/ and
dspark/ folders (a hub target: only the file needed is fetched). No torch here."""
from __future__ import annotations

from pathlib import Path

from m3serve.model.config import read_config_json
from m3serve.model.files import default_model_dir, resolve_model_dir


def dspark_config_path(draft: str | None, target: str | None) -> Path:
    """The DSpark draft's config.json: in the draft folder `draft`, else in the target's dspark/
    folder (a hub target: its dspark/config.json alone is fetched)."""
    if draft is not None:
        return resolve_model_dir(draft, config_only=True) / "config.json"
    if target is None:
        target = str(default_model_dir())
    if not Path(target).exists() and str(target).count("/") == 1:
        try:
            from huggingface_hub import hf_hub_download
            return Path(hf_hub_download(str(target), "dspark/config.json"))
        except Exception as e:
            raise ValueError(f"speculative_config: DSpark draft of {target!r}: dspark/config.json could "
                             f"not be fetched ({e}); pass num_speculative_tokens and model") from e
    return Path(target) / "dspark" / "config.json"


def eagle3_draft_dir(draft: str | None, target: str | None, config_only: bool = False) -> Path:
    """The EAGLE3 draft's folder: `draft` (a directory or hub id), else the target's eagle3/
    folder (the embedded tiny model ships one); a target without one needs `draft`."""
    if draft is not None:
        return resolve_model_dir(draft, config_only=config_only)
    folder = (default_model_dir() if target is None else Path(target)) / "eagle3"
    if not (folder / "config.json").is_file():
        raise ValueError(f"speculative_config.model (the EAGLE3 draft: a directory or hub id) is required "
                         f"with method 'eagle3': the target has no eagle3/ folder ({folder})")
    return folder


def read_dspark_config(path: Path) -> tuple[dict, dict]:
    """(the whole config.json, its text_config, or the whole where it has none) of a DSpark
    draft; ValueError naming the file when it cannot be read."""
    try:
        raw = read_config_json(Path(path).parent, "DSpark draft")
    except ValueError as e:
        raise ValueError(f"speculative_config: DSpark draft config {path} cannot be read ({e}); name the "
                         f"draft folder in speculative_config.model") from None
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ValueError(f"DSpark draft config {path}: 'text_config' must be an object (got {text!r})")
    return raw, text


def dspark_block_size(draft: str | None, target: str | None) -> int:
    """The DSpark draft's `dspark_block_size`: the default number of speculative tokens."""
    path = dspark_config_path(draft, target)
    raw, text = read_dspark_config(path)
    size = text.get("dspark_block_size", raw.get("dspark_block_size"))
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 16:
        raise ValueError(f"DSpark draft config {path}: 'dspark_block_size' must be an integer in [1, 16] "
                         f"(got {size!r})")
    return size
