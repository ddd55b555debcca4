"""The config.json of the MiniMax checkpoints m3serve knows, shipped in the package so that tools
which read only the config (`m3serve plan`) work offline. Each copy carries a label saying how
faithful it is; callers must show it, so a plan never silently rests on a reconstruction.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class KnownConfig:
    repo_id: str
    file: str
    label: str                 # how faithful the copy is, shown to the user
    reconstructed: bool = False

    def load(self) -> dict:
        return json.loads((_DIR / self.file).read_text(encoding="utf-8"))


KNOWN_CONFIGS = {c.repo_id.lower(): c for c in (
    KnownConfig("MiniMaxAI/MiniMax-M3", "MiniMax-M3.json",
                "the published config.json's model values (text, sparse attention, vision)"),
    KnownConfig("MiniMaxAI/MiniMax-M3-MXFP8", "MiniMax-M3-MXFP8.json",
                "MiniMax-M3's values plus quantization_config.quant_method mxfp8 (its ignored_layers list is "
                "not reproduced)"),
    KnownConfig("MiniMaxAI/MiniMax-M3.1-Flash", "MiniMax-M3.1-Flash.json",
                "RECONSTRUCTED, not the published file (which was not available): MiniMax-M3's values with "
                "sparse attention (MSA) in all 60 layers, the FFN schedule unchanged, no MTP, and the "
                "mixed NVFP4-experts / MXFP8 quantization_config keys; verify against the real config.json",
                reconstructed=True),
)}


def known_config(model: str) -> KnownConfig | None:
    """The shipped config of a hub repo id (case-insensitive), or None."""
    return KNOWN_CONFIGS.get(str(model).lower())
