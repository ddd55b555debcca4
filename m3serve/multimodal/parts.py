"""Image and video content parts of chat messages (OpenAI `image_url` / `video_url`, Responses
`input_image`, Anthropic-converted `image_url`, and the offline API's `image_pil`): the marker text
each one renders as, and resolving them, in message order, into preprocessed items."""
from __future__ import annotations

from dataclasses import dataclass

from m3serve.multimodal.markers import MARKERS, check_limits
from m3serve.multimodal.media import MediaPolicy, decode_image, decode_video, load_bytes

# content part type -> modality
PART_TYPES = {"image_url": "image", "input_image": "image", "image_pil": "image", "video_url": "video"}


@dataclass
class MediaPart:
    modality: str
    where: str            # "messages[0].content[1]", named in errors
    source: object        # a URL string, or a decoded image (image_pil)


def part_marker(part: dict, where: str) -> str:
    """The text a media part stands as in the prompt (its modality's marker)."""
    modality = PART_TYPES[part["type"]]
    _source(part, where)
    return MARKERS[modality]


def _source(part: dict, where: str):
    kind = part["type"]
    if kind == "image_pil":
        if part.get("image_pil") is None:
            raise ValueError(f"{where}.image_pil is missing")
        return part["image_pil"]
    if kind == "input_image":
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}.image_url must be a URL string (file_id inputs are not supported)")
        return url
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}.{kind}.url must be a non-empty string")
    return url


def collect_media_parts(messages) -> list[MediaPart]:
    """The media parts of OpenAI-style messages, in order (already validated by rendering)."""
    parts = []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in PART_TYPES:
                # a part converted from another API carries its own request path
                where = part.get("_where") if isinstance(part.get("_where"), str) else f"messages[{i}].content[{j}]"
                parts.append(MediaPart(PART_TYPES[part["type"]], where, _source(part, where)))
    return parts


def check_upscale(options, policy: MediaPolicy) -> None:
    """The processor enlarges a small image to `min_pixels` (a video frame to
    `video_min_pixels`): neither may exceed the decode bound, or a tiny file would expand past it."""
    for name in ("min_pixels", "video_min_pixels"):
        value = getattr(options, name)
        if value > policy.max_image_pixels:
            raise ValueError(f"mm_processor_kwargs.{name}: {value} is more than the server's "
                             f"--max-image-pixels ({policy.max_image_pixels})")


def resolve_parts(parts: list[MediaPart], policy: MediaPolicy, options, limits: dict[str, int]) -> list:
    """Fetch, decode and preprocess every part into `processor.VisionItem`s (blocking: call off
    the event loop). Errors are ValueErrors naming the part."""
    from m3serve.multimodal.processor import preprocess_image, preprocess_video
    counts = {}
    for p in parts:
        counts[p.modality] = counts.get(p.modality, 0) + 1
    check_limits(counts, limits)
    check_upscale(options, policy)
    items = []
    for p in parts:
        try:
            if p.modality == "image":
                image = p.source if not isinstance(p.source, str) else \
                    decode_image(load_bytes(p.source, "image", policy), policy)
                items.append(preprocess_image(image, options))
            else:
                frames, fps = decode_video(load_bytes(p.source, "video", policy), policy)
                items.append(preprocess_video(frames, options, fps=fps))
        except ValueError as e:
            raise ValueError(f"{p.where}: {e}") from None
    return items
