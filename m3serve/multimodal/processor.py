"""Pixels for MiniMax-M3's vision tower: decoded images and video frames in, flattened patches,
their (t, h, w) grids and the number of placeholder tokens out.

The rules are transformers' `minimax_m3_vl` image and video processors': RGB (transparency
composited onto white), bicubic resize (antialiased) so both sides are multiples of 28 (patch 14 x
merge 2) with the pixel count inside [min_pixels, max_pixels], rescale by 1/255 and CLIP
normalisation, each image repeated to the temporal patch of 2 frames, and the patches of every
2 x 2 merge group stored next to each other. A video's frames are padded to an even count (the
last frame repeated), cut into temporal patches of 2, and split into attention segments of at most
`segment_max_frames` temporal patches, one grid per segment.

Only torch and numpy here; decoding bytes (Pillow, PyAV) lives in `multimodal/decode.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from m3serve.multimodal.processor_config import (  # noqa: F401  (the geometry and defaults live there)
    CLIP_MEAN, CLIP_STD, FACTOR, IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS, MAX_ASPECT_RATIO, MERGE_SIZE, PATCH_DIM,
    PATCH_SIZE, SEGMENT_MAX_FRAMES, TEMPORAL_PATCH_SIZE, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS)


@dataclass(frozen=True)
class ProcessorOptions:
    """Per-request knobs (vLLM's `mm_processor_kwargs` names); unknown keys are refused."""
    min_pixels: int = IMAGE_MIN_PIXELS
    max_pixels: int = IMAGE_MAX_PIXELS
    video_min_pixels: int = VIDEO_MIN_PIXELS
    video_max_pixels: int = VIDEO_MAX_PIXELS
    vision_segment_max_frames: int = SEGMENT_MAX_FRAMES

    @classmethod
    def from_kwargs(cls, kwargs: dict | None, base: "ProcessorOptions | None" = None) -> "ProcessorOptions":
        base = base or cls()
        if not kwargs:
            return base
        if not isinstance(kwargs, dict):
            raise ValueError(f"mm_processor_kwargs must be an object, got {type(kwargs).__name__}")
        known = set(cls.__dataclass_fields__)
        values = dict(base.__dict__)
        for key, value in kwargs.items():
            if key not in known:
                raise ValueError(f"mm_processor_kwargs: unknown key {key!r} (known: {', '.join(sorted(known))})")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mm_processor_kwargs.{key}: expected a positive integer, got {value!r}")
            values[key] = value
        opts = cls(**values)
        for lo, hi in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
            if getattr(opts, lo) > getattr(opts, hi):
                raise ValueError(f"mm_processor_kwargs: {lo} ({getattr(opts, lo)}) exceeds {hi} "
                                 f"({getattr(opts, hi)})")
            if getattr(opts, hi) < FACTOR * FACTOR:
                raise ValueError(f"mm_processor_kwargs.{hi}: {getattr(opts, hi)} is below one "
                                 f"{FACTOR}x{FACTOR} merge group")
        return opts


@dataclass
class VisionItem:
    """One image or video, ready for the vision tower.

    pixel_values: [num_patches, 1176] float32, in the tower's patch order.
    grids: (t, h, w) in patches per attention segment (an image has one, t = 1).
    num_tokens: placeholder tokens it fills (num_patches / 4).
    timestamps: a video's seconds per temporal patch (None = no timestamp markers).
    content_hash: hex digest of the decoded pixels and grid (prefix-cache key, dedup).
    """
    modality: str                              # "image" | "video"
    pixel_values: torch.Tensor
    grids: list[tuple[int, int, int]]
    num_tokens: int
    content_hash: str
    timestamps: list[float] | None = field(default=None)

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])

    @property
    def tokens_per_frame(self) -> int:
        """Tokens of one temporal patch (video: the size of each bracketed span)."""
        _, h, w = self.grids[0]
        return h * w // (MERGE_SIZE * MERGE_SIZE)

    @property
    def num_temporal_patches(self) -> int:
        return sum(t for t, _, _ in self.grids)


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int,
                 factor: int = FACTOR) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as rounding allows. Sides are first rounded to the nearest
    multiple; an area past a bound rescales both sides by the square root of the excess."""
    if height < 1 or width < 1:
        raise ValueError(f"image has no pixels ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {ratio:.1f} of a {width}x{height} image exceeds {MAX_ASPECT_RATIO}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb_tensor(image) -> torch.Tensor:
    """A PIL image or an [H, W] / [H, W, 3] / [H, W, 4] uint8 array -> uint8 [3, H, W].
    Transparency is composited onto white (PIL images through PIL, arrays by rounding)."""
    if hasattr(image, "getbands"):                       # a PIL image
        from PIL import Image
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(white, rgba).convert("RGB")
        else:
            image = image.convert("RGB")
        array = np.asarray(image)
    else:
        array = np.asarray(image)
        if array.dtype != np.uint8:
            raise ValueError(f"image arrays must be uint8, got {array.dtype}")
        if array.ndim == 2:
            array = np.repeat(array[..., None], 3, axis=-1)
        if array.ndim != 3 or array.shape[-1] not in (3, 4):
            raise ValueError(f"image array must be [H, W], [H, W, 3] or [H, W, 4], got {list(array.shape)}")
        if array.shape[-1] == 4:
            alpha = array[..., 3:4] / 255
            array = np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    if array.shape[0] < 1 or array.shape[1] < 1:
        raise ValueError(f"image has no pixels ({array.shape[1]}x{array.shape[0]})")
    return torch.from_numpy(np.array(array, copy=True)).permute(2, 0, 1).contiguous()


def resize(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [..., 3, H, W] -> uint8 [..., 3, height, width], antialiased bicubic (the kernel
    torchvision applies to uint8 tensors on the CPU)."""
    if tuple(pixels.shape[-2:]) == (height, width):
        return pixels
    lead = pixels.shape[:-3]
    flat = pixels.reshape(-1, *pixels.shape[-3:])
    out = F.interpolate(flat, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return out.reshape(*lead, *out.shape[-3:])


def normalize(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 3, H, W] -> float32 (x / 255 - mean) / std, in the fused form
    (x - 255 mean) / (255 std) so values equal the reference's bit for bit."""
    scale = 1.0 / (1 / 255)
    mean = (torch.tensor(CLIP_MEAN) * scale).view(3, 1, 1)
    std = (torch.tensor(CLIP_STD) * scale).view(3, 1, 1)
    return (pixels.to(torch.float32) - mean) / std


def patchify(frames: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """float [T, 3, H, W] (T a multiple of 2) -> ([T/2 * H/14 * W/14, 1176], t, h, w): for each
    temporal patch, the 2 x 2 merge groups in row-major order, each group's 4 patches row-major,
    each patch as (channel, frame, row, column)."""
    T, C, H, W = frames.shape
    t, h, w = T // TEMPORAL_PATCH_SIZE, H // PATCH_SIZE, W // PATCH_SIZE
    m, p = MERGE_SIZE, PATCH_SIZE
    x = frames.reshape(t, TEMPORAL_PATCH_SIZE, C, h // m, m, p, w // m, m, p)
    # -> [t, h/m, w/m, m(row), m(col), C, frame, p(row), p(col)]
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, C * TEMPORAL_PATCH_SIZE * p * p), t, h, w


def _content_hash(modality: str, frames: torch.Tensor, extra: str = "") -> str:
    import hashlib
    h = hashlib.sha256()
    h.update(f"{modality}:{list(frames.shape)}:{extra}".encode())
    h.update(frames.contiguous().numpy().tobytes())
    return h.hexdigest()


def preprocess_image(image, options: ProcessorOptions = ProcessorOptions()) -> VisionItem:
    """One decoded image (PIL or uint8 array) -> a `VisionItem` with one grid (1, h, w)."""
    rgb = to_rgb_tensor(image)                                      # [3, H, W] uint8
    height, width = smart_resize(rgb.shape[1], rgb.shape[2], options.min_pixels, options.max_pixels)
    resized = resize(rgb, height, width)
    # the hash covers the pixels the tower sees and how they were bounded
    digest = _content_hash("image", resized)
    frames = normalize(resized)[None].expand(TEMPORAL_PATCH_SIZE, -1, -1, -1)   # [2, 3, h, w]
    patches, t, h, w = patchify(frames)
    return VisionItem("image", patches, [(t, h, w)], t * h * w // (MERGE_SIZE ** 2), digest)


def preprocess_video(frames, options: ProcessorOptions = ProcessorOptions(),
                     fps: float | None = None) -> VisionItem:
    """Decoded frames ([T, H, W, 3] uint8 array, or a list of PIL images / arrays) -> a
    `VisionItem` with one grid per segment of at most `vision_segment_max_frames` temporal
    patches. With `fps` (of the frames as given), each temporal patch gets a timestamp."""
    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        frames = list(frames)
    frames = list(frames)
    if not frames:
        raise ValueError("video has no frames")
    rgb = [to_rgb_tensor(f) for f in frames]
    shape = rgb[0].shape
    if any(f.shape != shape for f in rgb):
        raise ValueError("video frames differ in size")
    video = torch.stack(rgb)                                        # [T, 3, H, W] uint8
    height, width = smart_resize(shape[1], shape[2], options.video_min_pixels, options.video_max_pixels)
    video = resize(video, height, width)
    # the segments are attention boundaries: the same frames cut otherwise give other features,
    # so two cuts must not share prefix-cache blocks
    digest = _content_hash("video", video, f"fps={fps}:segment={options.vision_segment_max_frames}")
    num_frames = video.shape[0]
    pixels = normalize(video)
    if pad := -num_frames % TEMPORAL_PATCH_SIZE:
        pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
    patches, t, h, w = patchify(pixels)
    limit = options.vision_segment_max_frames
    grids = [(min(limit, t - start), h, w) for start in range(0, t, limit)]
    timestamps = None
    if fps is not None:
        if not fps > 0:
            raise ValueError(f"video fps must be positive, got {fps}")
        timestamps = [min(i * TEMPORAL_PATCH_SIZE, num_frames - 1) / fps for i in range(t)]
    return VisionItem("video", patches, grids, t * h * w // (MERGE_SIZE ** 2), digest, timestamps)


def placeholder_parts(item: VisionItem, ids: dict[str, int]) -> list[str | list[int]]:
    """The prompt span an item expands to, in the order transformers' processor writes it: per
    image (or per temporal patch of a video, after a `]<]{seconds:.1f} seconds[>[` marker when the
    frame rate is known) start-of-image, the placeholder repeated, and end-of-image. The
    timestamp markers are plain text (str parts): they are tokenized together with the text
    before them, which `inputs.expand_prompt` does. ids: token ids of "image", "video",
    "image_start", "image_end"."""
    start, end = ids["image_start"], ids["image_end"]
    if item.modality == "image":
        return [[start] + [ids["image"]] * item.num_tokens + [end]]
    out: list[str | list[int]] = []
    span = [start] + [ids["video"]] * item.tokens_per_frame + [end]
    for i in range(item.num_temporal_patches):
        if item.timestamps is not None:
            out.append(f"]<]{item.timestamps[i]:.1f} seconds[>[")
        out.append(span)
    return out
