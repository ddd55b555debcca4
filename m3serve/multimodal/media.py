"""Media references of chat messages -> decoded pixels, within bounded bytes, pixels and time.

A reference is a `data:` URL (base64), an `http(s)://` URL (fetched by `fetch.py`: public
addresses only unless opted in, a size cap, a timeout, a content-type check and an optional
domain allow-list), or a `file://` URL under the one local directory the server allows. Images
decode with Pillow (an optional dependency) after their header passes the pixel bound, so a
decompression bomb is refused before it is expanded; videos decode with PyAV (optional), keeping
only the frames that will be sampled, within a bound on their decoded bytes. Every failure is a
ValueError saying what was wrong; callers prefix where the part was (`messages[0].content[1]`).

Blocking: run these off the event loop.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# 16 Mi pixels (4096 x 4096): a 12 to 16 MP camera photo passes; its RGB decode is 48 MiB
DEFAULT_MAX_IMAGE_PIXELS = 16 << 20
# the sampled frames of a video, as RGB: 32 frames of 3840 x 2160 fit
DEFAULT_MAX_VIDEO_DECODED_BYTES = 1 << 30


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from and how big it may be (vLLM's flag names where they exist)."""
    allowed_local_media_path: str | None = None       # file:// only under this directory
    allowed_media_domains: tuple[str, ...] | None = None   # http(s) hosts; None = any
    allow_private_media_addresses: bool = False       # http(s) hosts may resolve to non-public addresses
    fetch_timeout_s: float = 10.0                     # per URL (VLLM_IMAGE_FETCH_TIMEOUT's role)
    max_image_bytes: int = 20 << 20                   # encoded size of one image
    max_video_bytes: int = 200 << 20
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # decoded width x height of an image or a frame
    max_video_frames: int = 32                        # frames sampled from a video file
    max_video_total_frames: int = 4096                # frames a video file may have (decode time)
    max_video_decoded_bytes: int = DEFAULT_MAX_VIDEO_DECODED_BYTES  # RGB bytes of the sampled frames

    def __post_init__(self):
        for name in ("max_image_bytes", "max_video_bytes", "max_image_pixels", "max_video_frames",
                     "max_video_total_frames", "max_video_decoded_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_flags(cls, allowed_local_media_path: str | None = None, allowed_media_domains=None,
                   **kwargs) -> "MediaPolicy":
        domains = allowed_media_domains
        if isinstance(domains, str):
            domains = tuple(d.strip().lower() for d in domains.split(",") if d.strip())
        elif domains is not None:
            domains = tuple(str(d).lower() for d in domains)
        local = None
        if allowed_local_media_path:
            local = os.path.realpath(allowed_local_media_path)
            if not os.path.isdir(local):
                raise ValueError(f"--allowed-local-media-path {allowed_local_media_path!r} is not a directory")
        return cls(allowed_local_media_path=local, allowed_media_domains=domains or None, **kwargs)


def _limit(modality: str, policy: MediaPolicy) -> int:
    return policy.max_image_bytes if modality == "image" else policy.max_video_bytes


def _data_url(url: str, modality: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ValueError("malformed data URL (no comma)")
    mime = header[5:].split(";")[0].strip().lower()
    if mime and not mime.startswith(f"{modality}/") and mime != "application/octet-stream":
        raise ValueError(f"data URL media type {mime!r} is not an {modality} type")
    if len(payload) > _limit(modality, policy) * 4 // 3 + 4:
        raise ValueError(f"{modality} is larger than {_limit(modality, policy)} bytes")
    if ";base64" not in header.lower():
        return unquote(payload).encode("latin-1", errors="replace")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"data URL is not valid base64 ({e})") from None


def _file_url(url: str, modality: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_media_path is None:
        raise ValueError("file:// URLs are not allowed (the server has no --allowed-local-media-path)")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"file URL host {parsed.netloc!r} is not allowed")
    path = os.path.realpath(unquote(parsed.path))
    root = policy.allowed_local_media_path
    if os.path.commonpath([path, root]) != root:
        raise ValueError("file URL is outside --allowed-local-media-path")
    p = Path(path)
    if not p.is_file():
        raise ValueError("file URL names no readable file")
    if p.stat().st_size > _limit(modality, policy):
        raise ValueError(f"{modality} is larger than {_limit(modality, policy)} bytes")
    return p.read_bytes()


def _http_url(url: str, modality: str, policy: MediaPolicy) -> bytes:
    from m3serve.multimodal.fetch import fetch
    return fetch(url, modality, _limit(modality, policy), policy.fetch_timeout_s, policy.allowed_media_domains,
                 policy.allow_private_media_addresses)


def load_bytes(url: str, modality: str, policy: MediaPolicy) -> bytes:
    """The encoded bytes a media URL names."""
    if not isinstance(url, str) or not url:
        raise ValueError("url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        data = _data_url(url, modality, policy)
    elif scheme in ("http", "https"):
        data = _http_url(url, modality, policy)
    elif scheme == "file":
        data = _file_url(url, modality, policy)
    else:
        raise ValueError(f"unsupported URL scheme {scheme!r} (data, http, https, file)")
    if not data:
        raise ValueError(f"the {modality} is empty (0 bytes)")
    if len(data) > _limit(modality, policy):
        raise ValueError(f"{modality} is larger than {_limit(modality, policy)} bytes")
    return data


def decode_image(data: bytes, policy: MediaPolicy = MediaPolicy()):
    """Encoded image bytes -> a loaded PIL image; ValueError for an unsupported format, a size
    past `max_image_pixels` (checked from the header, before decoding), or corrupt data."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ValueError("images need Pillow on the server: pip install 'm3serve[vision]'") from None
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise ValueError("not a recognised image format") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ValueError(f"image has more than {policy.max_image_pixels} pixels") from None
        except Exception as e:
            raise ValueError(f"cannot read the image ({e})") from None
        if image.format not in IMAGE_FORMATS:
            raise ValueError(f"image format {image.format} is not supported ({', '.join(IMAGE_FORMATS)})")
        width, height = image.size
        if width < 1 or height < 1:
            raise ValueError(f"image has no pixels ({width}x{height})")
        if width * height > policy.max_image_pixels:
            raise ValueError(f"image is {width}x{height}, more than {policy.max_image_pixels} pixels")
        try:
            image.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ValueError(f"image has more than {policy.max_image_pixels} pixels") from None
        except Exception as e:
            raise ValueError(f"corrupt or truncated image ({type(e).__name__}: {e})") from None
    return image


def sample_indices(num_frames: int, num_kept: int) -> list[int]:
    """The frame indices kept from `num_frames`: at most `num_kept`, evenly spread, first and last
    included."""
    return np.unique(np.linspace(0, num_frames - 1, min(num_frames, num_kept)).round().astype(int)).tolist()


def _count_frames(data: bytes, policy: MediaPolicy) -> tuple[int, int, int]:
    """(frames, width, height) of the first video stream: the size from its header, the frames
    counted from its packets (demuxed, not decoded)."""
    import av
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise ValueError("the file has no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_frame_size(width, height, policy)
        count = 0
        for packet in container.demux(stream):
            if packet.size:
                count += 1
                if count > policy.max_video_total_frames:
                    raise ValueError(f"video has more than {policy.max_video_total_frames} frames")
    return count, width, height


def _check_decoded_bytes(num_kept: int, width: int, height: int, policy: MediaPolicy) -> None:
    size = num_kept * width * height * 3
    if size > policy.max_video_decoded_bytes:
        raise ValueError(f"the {num_kept} sampled {width}x{height} frames would decode to {size} bytes, "
                         f"more than {policy.max_video_decoded_bytes}")


def _check_frame_size(width: int, height: int, policy: MediaPolicy) -> None:
    if width * height > policy.max_image_pixels:
        raise ValueError(f"video frames are {width}x{height}, more than {policy.max_image_pixels} pixels")


def _decode_kept(data: bytes, keep: list[int], policy: MediaPolicy) -> tuple[np.ndarray | None, int, float | None]:
    """Decode up to the last kept frame, holding only the kept ones: (frames [len(keep), H, W, 3]
    or None when the stream ended first, frames decoded, the stream's rate)."""
    import av
    wanted = set(keep)
    out = None
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate) if stream.average_rate else None
        index = 0
        for frame in container.decode(stream):
            _check_frame_size(frame.width, frame.height, policy)
            if index in wanted:
                if out is None:              # the header's size may differ from the frames'
                    _check_decoded_bytes(len(keep), frame.width, frame.height, policy)
                    out = np.empty((len(keep), frame.height, frame.width, 3), np.uint8)
                elif (frame.height, frame.width) != out.shape[1:3]:
                    raise ValueError("video frames differ in size")
                out[keep.index(index)] = frame.to_ndarray(format="rgb24")
            index += 1
            if index > keep[-1]:
                return out, index, rate
            if index > policy.max_video_total_frames:
                raise ValueError(f"video has more than {policy.max_video_total_frames} frames")
    return None, index, rate


def decode_video(data: bytes, policy: MediaPolicy = MediaPolicy()) -> tuple[np.ndarray, float | None]:
    """Encoded video bytes -> (frames [T, H, W, 3] uint8, frames per second of the returned
    frames or None): at most `max_video_frames`, sampled evenly. The frame count comes from the
    packets, so decoding keeps only the sampled frames (within `max_video_decoded_bytes`) and
    stops after the last one. Needs PyAV."""
    try:
        import av
    except ImportError:
        raise ValueError("video files need PyAV on the server: pip install 'm3serve[video]'") from None
    try:
        num_frames, width, height = _count_frames(data, policy)
        frames = None
        if num_frames:
            keep = sample_indices(num_frames, policy.max_video_frames)
            _check_decoded_bytes(len(keep), width, height, policy)
            frames, decoded, rate = _decode_kept(data, keep, policy)
            if frames is None and decoded:      # fewer frames than packets: sample what there is
                num_frames = decoded
                keep = sample_indices(num_frames, policy.max_video_frames)
                frames, _, rate = _decode_kept(data, keep, policy)
    except av.FFmpegError as e:            # some of these are ValueErrors too: say what failed
        raise ValueError(f"cannot decode the video ({type(e).__name__}: {e})") from None
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"cannot decode the video ({type(e).__name__}: {e})") from None
    if frames is None:
        raise ValueError("video has no frames")
    fps = rate * len(keep) / num_frames if rate else None
    return frames, fps
