"""A checkpoint's image and video processor settings -> the base of `processor.ProcessorOptions`
that `--mm-processor-kwargs` and per-request `mm_processor_kwargs` override; also the patch
geometry and defaults the preprocessing is built for. No torch here (the API process reads it).

Files and keys as transformers 5.23 reads them: `processor_config.json`'s `image_processor` /
`video_processor` objects first; else `preprocessor_config.json` (image) and
`video_preprocessor_config.json`, then `preprocessor_config.json` (video). Values the
preprocessing cannot honour are a ValueError naming the file and field.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE             # sides are multiples of 28
PATCH_DIM = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE   # 1176 values per patch

IMAGE_MIN_PIXELS = 4 * 28 * 28               # 3,136
IMAGE_MAX_PIXELS = 672 * 672                 # 451,584 (vLLM's default bound)
VIDEO_MIN_PIXELS = 4 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28             # 602,112 per frame
SEGMENT_MAX_FRAMES = 4                       # temporal patches per attention segment
MAX_ASPECT_RATIO = 200
DEFAULTS = {"min_pixels": IMAGE_MIN_PIXELS, "max_pixels": IMAGE_MAX_PIXELS, "video_min_pixels": VIDEO_MIN_PIXELS,
            "video_max_pixels": VIDEO_MAX_PIXELS, "vision_segment_max_frames": SEGMENT_MAX_FRAMES}

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

PROCESSOR_FILE = "processor_config.json"
IMAGE_FILE = "preprocessor_config.json"
VIDEO_FILE = "video_preprocessor_config.json"

# fields whose only supported value is the one the preprocessing is built for
_FIXED = {"patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
          "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
          "resample": 3}                                 # PIL bicubic
_FIXED_FLOATS = {"rescale_factor": (1 / 255,), "image_mean": CLIP_MEAN, "image_std": CLIP_STD}


def _read(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable processor configuration ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _sections(model_dir: Path) -> dict[str, tuple[str, dict]]:
    """{"image": (where, settings), "video": (where, settings)} for the sections found."""
    found = {}
    nested = _read(model_dir / PROCESSOR_FILE)
    legacy = {name: _read(model_dir / name) for name in (IMAGE_FILE, VIDEO_FILE)}
    for modality, files in (("image", (IMAGE_FILE,)), ("video", (VIDEO_FILE, IMAGE_FILE))):
        key = f"{modality}_processor"
        if nested is not None and key in nested:
            if not isinstance(nested[key], dict):
                raise ValueError(f"{model_dir / PROCESSOR_FILE}: {key} must be an object")
            found[modality] = (f"{model_dir / PROCESSOR_FILE}: {key}.", nested[key])
            continue
        for name in files:
            if legacy[name] is not None:
                found[modality] = (f"{model_dir / name}: ", legacy[name])
                break
    return found


def _positive_int(where: str, field: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}{field}: expected a positive integer, got {value!r}")
    return value


def _check_fixed(where: str, settings: dict) -> None:
    for field, want in _FIXED.items():
        if field in settings and settings[field] is not None and settings[field] != want:
            raise ValueError(f"{where}{field}: {settings[field]!r} is not supported (only {want!r}: "
                             f"the preprocessing is built for it)")
    for field, want in _FIXED_FLOATS.items():
        value = settings.get(field)
        if value is None:
            continue
        values = [value] if isinstance(value, (int, float)) and len(want) == 1 else value
        if (not isinstance(values, (list, tuple)) or len(values) != len(want)
                or not all(isinstance(v, (int, float)) and math.isclose(v, w, rel_tol=1e-6)
                           for v, w in zip(values, want))):
            raise ValueError(f"{where}{field}: {value!r} is not supported (only "
                             f"{want[0] if len(want) == 1 else list(want)!r})")


def _image_bounds(where: str, settings: dict) -> dict:
    """min_pixels / max_pixels of the image processor: `size.shortest_edge` / `size.longest_edge`,
    overridden by top-level `min_pixels` / `max_pixels` (transformers' backward compatibility)."""
    out = {}
    size = settings.get("size")
    if size is not None and size != [672, 672]:       # transformers ignores that stale default
        if not isinstance(size, dict) or not {"shortest_edge", "longest_edge"} <= set(size):
            raise ValueError(f"{where}size: expected an object with shortest_edge and longest_edge, "
                             f"got {size!r}")
        out["min_pixels"] = _positive_int(where, "size.shortest_edge", size["shortest_edge"])
        out["max_pixels"] = _positive_int(where, "size.longest_edge", size["longest_edge"])
    for field in ("min_pixels", "max_pixels"):
        if settings.get(field) is not None:
            out[field] = _positive_int(where, field, settings[field])
    return out


def _video_settings(where: str, settings: dict) -> dict:
    out = {}
    for field in ("min_pixels", "max_pixels"):
        if field in settings:
            out[f"video_{field}"] = _positive_int(where, field, settings[field])
    if "vision_segment_max_frames" in settings:
        value = settings["vision_segment_max_frames"]
        if value is None:
            raise ValueError(f"{where}vision_segment_max_frames: null (one segment per video) is not "
                             f"supported; give a positive integer")
        out["vision_segment_max_frames"] = _positive_int(where, "vision_segment_max_frames", value)
    if settings.get("do_sample_frames"):
        # m3serve samples a file's frames itself (evenly, at most --max-video-frames)
        raise ValueError(f"{where}do_sample_frames: true is not supported (frames are sampled evenly, "
                         f"at most --max-video-frames); set it to false")
    return out


def load_processor_settings(model_dir: str | Path) -> dict[str, int]:
    """The checkpoint's processor settings as `ProcessorOptions` fields (built-in defaults where
    a file or field is absent)."""
    values: dict[str, int] = {}
    where_of: dict[str, str] = {}
    for modality, (where, settings) in _sections(Path(model_dir)).items():
        _check_fixed(where, settings)
        found = _image_bounds(where, settings) if modality == "image" else _video_settings(where, settings)
        values.update(found)
        where_of.update({k: where for k in found})
    options = {**DEFAULTS, **values}
    for lo, hi in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
        where = where_of.get(lo) or where_of.get(hi, "")
        name = (lambda f: f.removeprefix("video_")) if lo.startswith("video_") else (lambda f: f)
        if options[lo] > options[hi]:
            raise ValueError(f"{where}{name(lo)} ({options[lo]}) exceeds {name(hi)} "
                             f"({options[hi]})")
        if options[hi] < FACTOR * FACTOR:
            raise ValueError(f"{where}{name(hi)}: {options[hi]} is below one {FACTOR}x{FACTOR} "
                             f"merge group")
    return options
