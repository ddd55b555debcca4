"""`python -m m3serve.bench.vision`: the vision encoder at the real checkpoint's widths (1280
wide, 32 layers, projector and merge MLP into 6144) with random weights on one device: bf16
against the float32 encoder (the one tested equal to transformers), images per second at 672²
and at a 1920 x 1080 screenshot (after the default resize), one image per forward and 16, the
CPU preprocessing time, and the encoder-cache bytes per image. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def _random_(encoder, seed: int) -> None:
    from m3serve.model.loader import randomize_vision_
    randomize_vision_(encoder, torch.Generator().manual_seed(seed))


def _timed(fn, device, iters: int) -> float:
    """Mean seconds per call after two warm-up calls."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _profile(encoder, items, device) -> None:
    """Print the operators and kernels of one forward over `items`, by device time."""
    from torch.profiler import ProfilerActivity, profile
    pv = torch.cat([it.pixel_values for it in items]).to(device)
    grids = [g for it in items for g in it.grids]
    for _ in range(2):
        encoder(pv, grids)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        encoder(pv, grids)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=30))


def _attention_backends(cfg, device, iters: int) -> dict:
    """ms per call of one layer's attention over 1 and 16 672² images (2,304 patches each) in
    bf16: torch's variable-length flash call (the encoder's), and SDPA's flash and cuDNN
    backends over [images, heads, patches, head_dim]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from m3serve.model.vision import _varlen_attn
    out = {}
    for images in (1, 16):
        n, h, d = images * 2304, cfg.num_attention_heads, cfg.head_dim
        q, k, v = (torch.randn(n, h, d, device=device, dtype=torch.bfloat16) for _ in range(3))
        cu = torch.arange(0, n + 1, 2304, device=device, dtype=torch.int32)
        four = [t.view(images, 2304, h, d).transpose(1, 2) for t in (q, k, v)]
        calls = {"varlen_flash": lambda: _varlen_attn()(q, k, v, cu, cu, 2304, 2304)}
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            def call(backend=backend):
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(*four)
            calls[name] = call
        for name, fn in calls.items():
            try:
                out[f"{name}_images{images}_ms"] = round(_timed(fn, device, iters) * 1e3, 3)
            except RuntimeError as e:
                out[f"{name}_images{images}_ms"] = f"unavailable: {str(e)[:80]}"
    return out


def main(argv=None) -> None:
    from m3serve.model.known_configs import __path__ as known
    from m3serve.model.vision import VisionEncoder, _use_varlen, parse_vision_config
    from m3serve.multimodal.processor import preprocess_image
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--profile", action="store_true",
                        help="instead of the report: torch.profiler's table of one forward of "
                             "--profile-batch distinct 672² images")
    parser.add_argument("--profile-batch", type=int, default=1)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    raw = json.loads((__import__("pathlib").Path(known[0]) / "MiniMax-M3.json").read_text())
    vision = dict(raw["vision_config"], num_hidden_layers=args.layers)
    cfg = parse_vision_config(vision, raw["projector_hidden_size"], raw["text_config"]["hidden_size"])
    ref = VisionEncoder(cfg, torch.float32)
    _random_(ref, 0)
    fast = VisionEncoder(cfg, torch.bfloat16)
    fast.load_state_dict(ref.state_dict())
    ref, fast = ref.to(device).eval(), fast.to(device).eval()
    rng = np.random.default_rng(0)
    if args.profile:
        _profile(fast, [preprocess_image(rng.integers(0, 256, (672, 672, 3), dtype=np.uint8))
                        for _ in range(args.profile_batch)], device)
        return
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "layers": args.layers, "params": sum(p.numel() for p in ref.parameters()),
              "attention": "varlen" if _use_varlen(torch.empty(0, device=device, dtype=torch.bfloat16)) else "runs"}
    for name, (w, h) in {"672x672": (672, 672), "1920x1080": (1920, 1080)}.items():
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        start = time.perf_counter()
        item = preprocess_image(pixels)
        prep_s = time.perf_counter() - start
        pv = item.pixel_values.to(device)
        want = ref(pv, item.grids).float()
        got = fast(pv, item.grids).float()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        entry = {"resized": [item.grids[0][2] * 14, item.grids[0][1] * 14], "patches": item.num_patches,
                 "tokens": item.num_tokens, "preprocess_ms": round(prep_s * 1e3, 2),
                 "bf16_vs_fp32_max_abs_over_max": float((got - want).abs().max() / want.abs().max()),
                 "bf16_vs_fp32_cosine_min": float(cos.min()), "bf16_vs_fp32_cosine_mean": float(cos.mean()),
                 "encoder_cache_bytes": item.num_tokens * cfg.text_hidden_size * 2}
        # 16 distinct images of this size per forward (one image repeated would flatter any cache)
        items = [item] + [preprocess_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(15)]
        for batch in (1, 16):
            pvs = torch.cat([it.pixel_values for it in items[:batch]]).to(device)
            grids = [g for it in items[:batch] for g in it.grids]
            seconds = _timed(lambda: fast(pvs, grids), device, args.iters)
            entry[f"images_per_s_batch{batch}"] = round(batch / seconds, 2)
            entry[f"ms_per_forward_batch{batch}"] = round(seconds * 1e3, 2)
        report[name] = entry
    # a step's images rarely share one size: 16 of four sizes, interleaved
    sizes = [(672, 672), (1280, 720), (800, 600), (1024, 768)] * 4
    items = [preprocess_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    pvs = torch.cat([it.pixel_values for it in items]).to(device)
    grids = [g for it in items for g in it.grids]
    seconds = _timed(lambda: fast(pvs, grids), device, args.iters)
    report["mixed16"] = {"sizes": sorted(set(sizes)), "patches": int(pvs.shape[0]),
                         "images_per_s": round(16 / seconds, 2), "ms_per_forward": round(seconds * 1e3, 2)}
    if device.type == "cuda":
        report["attention_one_layer"] = _attention_backends(cfg, device, args.iters)
        report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
