"""The vision marker strings of MiniMax-M3's vocabulary and the per-prompt media limits; no torch
here, so the API process imports it for every chat request."""
from __future__ import annotations

MARKERS = {"image": "]<]image[>[", "video": "]<]video[>["}
SPAN_MARKERS = {"image_start": "]<]start of image[>[", "image_end": "]<]end of image[>["}
MODALITIES = ("image", "video")


def check_limits(counts: dict[str, int], limits: dict[str, int]) -> None:
    for modality in MODALITIES:
        n, limit = counts.get(modality, 0), limits.get(modality, 0)
        if n > limit:
            raise ValueError(f"too many {modality}s in one prompt: {n}, at most {limit} "
                             f"(--limit-mm-per-prompt)")


