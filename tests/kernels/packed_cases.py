"""Packed weights for the packed-kernel tests (CPU interpreter and GPU): one weight quantised in
each format by `kernels/ref/packed.py`, with its dequantised twin."""
import torch

from m3serve.kernels.ref import packed as rp

FORMATS = ["mxfp8", "mxfp4", "nvfp4", "nvfp4-modelopt"]


def quantized(w: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32):
    """(codes, block scales, global scales or None, kind, divides, dequantised in `dtype`).
    "nvfp4-modelopt" stores the reciprocal global scale and multiplies by it."""
    g, kind, divides = None, fmt.split("-")[0], fmt != "nvfp4-modelopt"
    if kind == "mxfp8":
        c, s = rp.quantize_mxfp8(w)
    elif kind == "mxfp4":
        c, s = rp.quantize_mxfp4(w)
    else:
        g = rp.nvfp4_global_scale(w.float().abs().amax(-1))
        c, s = rp.quantize_nvfp4(w, g)
        if not divides:
            g = 1.0 / g
    return c, s, g, kind, divides, rp.dequantize(kind, c, s, g, divides).to(dtype)
