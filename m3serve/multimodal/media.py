"""Media references of chat messages -> decoded pixels, within bounded bytes, pixels and time.

A reference is a `data:` URL (base64), an `http(s)://` URL (fetched with a size cap, a timeout, a
content-type check and an optional domain allow-list), or a `file://` URL under the one local
directory the server allows. Images decode with Pillow (an optional dependency) after their
header passes the pixel bound, so a decompression bomb is refused before it is expanded; videos
decode with PyAV (optional). Every failure is a ValueError saying what was wrong; callers prefix
where the part was (`messages[0].content[1]`).

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


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from and how big it may be (vLLM's flag names where they exist)."""
    allowed_local_media_path: str | None = None       # file:// only under this directory
    allowed_media_domains: tuple[str, ...] | None = None   # http(s) hosts; None = any
    fetch_timeout_s: float = 10.0                     # per URL (VLLM_IMAGE_FETCH_TIMEOUT's role)
    max_image_bytes: int = 20 << 20                   # encoded size of one image
    max_video_bytes: int = 200 << 20
    max_image_pixels: int = 64 << 20                  # decoded width x height (a bomb is larger)
    max_video_frames: int = 32                        # frames sampled from a video file

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
    import httpx
    host = (urlparse(url).hostname or "").lower()
    if not host:
        raise ValueError("URL has no host")
    if policy.allowed_media_domains is not None and host not in policy.allowed_media_domains:
        raise ValueError(f"media host {host!r} is not in --allowed-media-domains")
    limit = _limit(modality, policy)
    try:
        # no redirects: a redirect could leave the allowed domains
        with httpx.Client(timeout=policy.fetch_timeout_s, follow_redirects=False) as client:
            with client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise ValueError(f"fetching the URL answered HTTP {r.status_code}")
                ctype = r.headers.get("content-type", "").split(";")[0].strip().lower()
                if ctype and not ctype.startswith(f"{modality}/") and ctype != "application/octet-stream":
                    raise ValueError(f"the URL's content type {ctype!r} is not an {modality} type")
                declared = r.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > limit:
                    raise ValueError(f"{modality} is larger than {limit} bytes")
                data = bytearray()
                for chunk in r.iter_bytes():
                    data += chunk
                    if len(data) > limit:
                        raise ValueError(f"{modality} is larger than {limit} bytes")
                return bytes(data)
    except httpx.TimeoutException:
        raise ValueError(f"fetching the URL took longer than {policy.fetch_timeout_s} s") from None
    except httpx.HTTPError as e:
        raise ValueError(f"cannot fetch the URL ({type(e).__name__}: {e})") from None


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


def decode_video(data: bytes, policy: MediaPolicy = MediaPolicy()) -> tuple[np.ndarray, float | None]:
    """Encoded video bytes -> (frames [T, H, W, 3] uint8, frames per second of the returned
    frames or None): at most `max_video_frames`, sampled evenly. Needs PyAV."""
    try:
        import av
    except ImportError:
        raise ValueError("video files need PyAV on the server: pip install 'm3serve[video]'") from None
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            stream = container.streams.video[0]
            frames = []
            for frame in container.decode(stream):
                if frame.width * frame.height > policy.max_image_pixels:
                    raise ValueError(f"video frames are {frame.width}x{frame.height}, more than "
                                     f"{policy.max_image_pixels} pixels")
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) > 4096:
                    raise ValueError("video has more than 4096 frames")
            rate = float(stream.average_rate) if stream.average_rate else None
    except av.FFmpegError as e:            # some of these are ValueErrors too: say what failed
        raise ValueError(f"cannot decode the video ({type(e).__name__}: {e})") from None
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"cannot decode the video ({type(e).__name__}: {e})") from None
    if not frames:
        raise ValueError("video has no frames")
    keep = np.unique(np.linspace(0, len(frames) - 1, min(len(frames), policy.max_video_frames)).round().astype(int))
    fps = rate * len(keep) / len(frames) if rate else None
    return np.stack([frames[i] for i in keep]), fps
