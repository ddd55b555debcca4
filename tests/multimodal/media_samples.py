"""Encoded images for the bad-input tests: good ones, and ones that are broken on purpose."""
import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def png_bytes(width=64, height=48, seed=0, mode="RGB") -> bytes:
    channels = {"RGB": 3, "RGBA": 4}[mode]
    array = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(array, mode).save(out, format="PNG")
    return out.getvalue()


def jpeg_bytes(width=64, height=48, seed=0) -> bytes:
    array = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="JPEG")
    return out.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with a tiny (wrong) payload: a decompression
    bomb as far as the header goes, never expanded."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00" * 16))
            + _chunk(b"IEND", b""))


def ppm_bytes() -> bytes:
    return b"P6\n4 4\n255\n" + bytes(48)


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


# (name, encoded bytes, a phrase the 400 must contain)
BAD_IMAGES = [
    ("truncated", png_bytes(200, 200)[:400], "corrupt or truncated"),
    ("corrupt", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, "not a recognised image format"),
    ("not an image", b"hello, this is text", "not a recognised image format"),
    ("bomb", png_header_only(100_000, 100_000), "image has more than"),
    ("enormous", png_header_only(9_000, 9_000), "image is 9000x9000, more than"),
    ("zero size", png_header_only(0, 10), "not a recognised image format"),
    ("unsupported format", ppm_bytes(), "format PPM is not supported"),
    ("empty", b"", "empty"),
]


def mp4_bytes(num_frames=6, width=84, height=56, fps=4) -> bytes:
    """A short MPEG-4 video of random frames (needs PyAV)."""
    import av
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            array = np.random.default_rng(100 + i).integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()
