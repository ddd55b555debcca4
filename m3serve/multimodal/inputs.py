"""A request's media between the front end and the model: `multi_modal_data` parsed and
preprocessed, the prompt's `]<]image[>[` / `]<]video[>[` markers expanded into placeholder spans,
and where each item's placeholders sit in the prompt.

Items of one modality fill that modality's markers in order (images and videos are counted
separately, as transformers scatters them). Mismatched counts are a ValueError naming them. The
ids equal those of transformers' processor, which writes the expansions into the text and
tokenizes it whole: a video's timestamp markers are text, tokenized with the text before them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import torch

from m3serve.multimodal.markers import MARKERS, MODALITIES, SPAN_MARKERS, check_limits
from m3serve.multimodal.processor import (ProcessorOptions, VisionItem, placeholder_parts,
                                          preprocess_image, preprocess_video)
from m3serve.protocol import MultiModalInput

def media_token_ids(token_to_id: Callable[[str], int | None]) -> dict[str, int]:
    """The ids of the four vision markers in a tokenizer; ValueError if one is missing."""
    ids = {}
    for name, text in {**MARKERS, **SPAN_MARKERS}.items():
        token_id = token_to_id(text)
        if token_id is None:
            raise ValueError(f"the tokenizer has no {text!r} token: this model cannot take images")
        ids[name] = token_id
    return ids


def to_engine_input(item: VisionItem) -> MultiModalInput:
    return MultiModalInput(item.modality, item.pixel_values.contiguous().numpy().tobytes(),
                           item.num_patches, [tuple(g) for g in item.grids], item.num_tokens,
                           item.content_hash)


def pixel_values(item: MultiModalInput) -> torch.Tensor:
    """[num_patches, 1176] float32 view of an input's pixel bytes."""
    return torch.frombuffer(bytearray(item.pixel_values), dtype=torch.float32).view(item.num_patches, -1)


def encoder_key(item: MultiModalInput) -> str:
    """The encoder cache's key of an input: its content hash and its attention segments (a
    video cut into other segments gives other features from the same pixels)."""
    return item.content_hash + ":" + ",".join(f"{t}x{h}x{w}" for t, h, w in item.grids)


def without_pixels(item: MultiModalInput) -> MultiModalInput:
    """The input with its pixel bytes dropped (everything else kept)."""
    return msgspec.structs.replace(item, pixel_values=b"")


def _as_list(value, modality: str) -> list:
    """One item or a list of items. A video is a [T, H, W, 3] array, a {"frames", "fps"} dict,
    or a list of frames (PIL images or [H, W, 3] arrays); a list of those is several videos."""
    if not isinstance(value, (list, tuple)):
        return [value]
    if modality == "video" and value and not isinstance(value[0], (list, tuple, dict)) \
            and not (isinstance(value[0], np.ndarray) and value[0].ndim == 4):
        return [value]                        # the frames of one video
    return list(value)


def process_multi_modal_data(data: dict, options: ProcessorOptions, limits: dict[str, int]) -> list[VisionItem]:
    """`multi_modal_data` of the offline API ({"image": one or a list, "video": one or a list})
    -> preprocessed items, images first then videos (each in the order given)."""
    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data must be a dict, got {type(data).__name__}")
    unknown = set(data) - set(MODALITIES)
    if unknown:
        raise ValueError(f"multi_modal_data: unsupported modality {sorted(unknown)[0]!r} (image, video)")
    grouped = {m: _as_list(data[m], m) for m in MODALITIES if data.get(m) is not None}
    check_limits({m: len(v) for m, v in grouped.items()}, limits)
    items = [preprocess_image(x, options) for x in grouped.get("image", [])]
    for video in grouped.get("video", []):
        fps = None
        if isinstance(video, dict):           # {"frames": ..., "fps": ...}
            video, fps = video.get("frames"), video.get("fps")
        items.append(preprocess_video(video, options, fps=fps))
    return items


def expand_prompt(prompt_ids: Sequence[int], items: Sequence[VisionItem], ids: dict[str, int],
                  tokenizer=None) -> list[int]:
    """Replace the k-th image (video) marker of the prompt by the k-th image's (video's)
    placeholder span. The number of markers of each modality must equal its items.

    A timestamp marker is text: the tokenizer (a `tokenizers.Tokenizer`, needed only for videos
    with timestamps) re-tokenizes it together with the text since the last added token before
    it, the segment the reference's tokenizer sees, so a merge across the marker's boundary
    gives the reference's ids."""
    queues = {m: [x for x in items if x.modality == m] for m in MODALITIES}
    counts = {m: sum(1 for t in prompt_ids if t == ids[m]) for m in MODALITIES}
    for m in MODALITIES:
        if counts[m] != len(queues[m]):
            raise ValueError(f"the prompt has {counts[m]} {MARKERS[m]} marker(s) but {len(queues[m])} "
                             f"{m}(s) were given")
    out: list[int] = []
    taken = {m: 0 for m in MODALITIES}
    by_id = {ids[m]: m for m in MODALITIES}
    added: set[int] | None = None
    for token in prompt_ids:
        m = by_id.get(token)
        if m is None:
            out.append(token)
            continue
        for part in placeholder_parts(queues[m][taken[m]], ids):
            if not isinstance(part, str):
                out += part
                continue
            if tokenizer is None:
                raise ValueError("a video with timestamps needs the tokenizer to expand its markers")
            if added is None:
                added = set(tokenizer.get_added_tokens_decoder())
            start = len(out)
            while start > 0 and out[start - 1] not in added:
                start -= 1
            text = tokenizer.decode(out[start:], skip_special_tokens=False) + part
            segment = tokenizer.encode(text, add_special_tokens=False).ids
            if any(t in added for t in segment):
                # the ids before the marker spell an added token (given as plain pieces)
                raise ValueError(f"the prompt's text before a {MARKERS['video']} marker re-tokenizes "
                                 f"to a special token")
            out[start:] = segment
        taken[m] += 1
    return out


def media_spans(prompt_ids: Sequence[int], mm_inputs: Sequence[MultiModalInput], image_id: int,
                video_id: int) -> list[tuple[int, int]]:
    """[start, end) over each input's placeholder tokens, in `mm_inputs` order: the k-th item of
    a modality owns the next `num_tokens` placeholders of that modality. ValueError when the
    prompt's placeholders do not add up to the inputs'."""
    positions = {"image": [], "video": []}
    for pos, token in enumerate(prompt_ids):
        if token == image_id:
            positions["image"].append(pos)
        elif token == video_id:
            positions["video"].append(pos)
    used = {"image": 0, "video": 0}
    spans = []
    for item in mm_inputs:
        if item.modality not in used:
            raise ValueError(f"unsupported modality {item.modality!r}")
        pos, k = positions[item.modality], used[item.modality]
        if item.num_tokens <= 0 or k + item.num_tokens > len(pos):
            raise ValueError(f"the prompt has fewer {item.modality} placeholder tokens than its "
                             f"{item.modality}s need")
        spans.append((pos[k], pos[k + item.num_tokens - 1] + 1))
        used[item.modality] = k + item.num_tokens
    for m in MODALITIES:
        if used[m] != len(positions[m]):
            raise ValueError(f"the prompt has {len(positions[m])} {m} placeholder tokens but its "
                             f"{m}s fill {used[m]}")
    return spans
