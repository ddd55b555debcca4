"""Draft checkpoints for the tiny target, written once per session: EAGLE3 (MHA, GQA) in the
Inferact layout, a standalone MTP checkpoint, a copy of the tiny target with the same MTP
modules bundled into its own checkpoint, and a copy with a DSpark draft in its dspark/ folder;
and EAGLE3, MTP and DSpark drafts for the tiny vision checkpoint."""
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))     # the server helpers


@pytest.fixture(scope="session")
def drafts(tiny_dir, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from m3serve.distill.tiny_drafts import make_draft

    root = tmp_path_factory.mktemp("drafts")
    out = {kind: make_draft(root / kind, kind, tiny_dir, seed=5) for kind in ("eagle3", "eagle3-gqa", "mtp")}
    bundled = root / "bundled-target"
    shutil.copytree(tiny_dir, bundled)
    tensors = load_file(str(out["mtp"] / "model.safetensors"))
    save_file({"language_model." + k: v for k, v in tensors.items()}, str(bundled / "mtp.safetensors"))
    raw = json.loads((bundled / "config.json").read_text())
    raw["text_config"]["num_mtp_modules"] = json.loads((out["mtp"] / "config.json").read_text())["num_mtp_modules"]
    (bundled / "config.json").write_text(json.dumps(raw, indent=2))
    out["bundled"] = bundled
    with_dspark = root / "dspark-target"
    shutil.copytree(tiny_dir, with_dspark)
    make_draft(with_dspark, "dspark", tiny_dir, seed=5)
    out["dspark"] = with_dspark
    return out



@pytest.fixture(scope="session")
def vision_drafts(tiny_vision_dir, tmp_path_factory):
    """Drafts for the tiny vision checkpoint: an EAGLE3 head and a standalone MTP checkpoint
    (served beside it), and a copy of it with a DSpark draft in its dspark/ folder (the target
    to serve)."""
    from m3serve.distill.tiny_drafts import make_draft

    root = tmp_path_factory.mktemp("vision_drafts")
    out = {kind: make_draft(root / kind, kind, tiny_vision_dir, seed=5) for kind in ("eagle3", "mtp")}
    with_dspark = root / "dspark-target"
    shutil.copytree(tiny_vision_dir, with_dspark)
    make_draft(with_dspark, "dspark", tiny_vision_dir, seed=5)
    out["dspark"] = with_dspark
    return out
