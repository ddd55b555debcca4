"""transformers' `minimax_m3_vl` image and video processors for reference tests.

They need torchvision (a build for another torch is imported without its compiled operators by
tests/conftest.py). Without torchvision the tests that need it skip, or fail with
M3SERVE_REQUIRE_TEST_DEPS=1 (set by .ci/run).
"""
import os

import pytest
import torch


def import_torchvision():
    """Import torchvision (tests/conftest.py imported it already where it is installed, without
    its compiled operators if they do not load), or skip the test (fail with
    M3SERVE_REQUIRE_TEST_DEPS=1, as in CI)."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        if os.environ.get("M3SERVE_REQUIRE_TEST_DEPS") == "1":
            pytest.fail("the transformers processors need torchvision, and M3SERVE_REQUIRE_TEST_DEPS=1 "
                        "says these tests must run here (pip install --no-deps torchvision==<the torch "
                        "release's>)")
        pytest.skip("the transformers processors need torchvision")


def hf_processors():
    """(image processor, video processor) of transformers 5.23."""
    import_torchvision()
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
    from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor
    return MiniMaxM3VLImageProcessor(), MiniMaxM3VLVideoProcessor()


# Inputs of the recorded transformers outputs (hf_processor_digests.json): seeded arrays, so
# the digests can be checked where torchvision is missing (CI).
def digest_cases():
    import numpy as np
    cases = {}
    for w, h in [(150, 100), (20, 12), (672, 672), (1920, 1080), (60, 900), (333, 71)]:
        cases[f"image_{w}x{h}"] = ("image", np.random.default_rng(w * h).integers(0, 256, (h, w, 3), dtype=np.uint8))
    cases["video_7x90x130"] = ("video", np.random.default_rng(7).integers(0, 256, (7, 90, 130, 3), dtype=np.uint8))
    return cases


def digest(tensor) -> str:
    import hashlib
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def record_digests(path) -> None:
    """Write transformers' pixel values (as sha256 digests) and grids for `digest_cases()`."""
    import json
    image_processor, video_processor = hf_processors()
    out = {}
    for name, (kind, array) in digest_cases().items():
        if kind == "image":
            ref = image_processor(images=[array], return_tensors="pt")
            pixels, grids = ref["pixel_values"], ref["image_grid_thw"]
        else:
            ref = video_processor(videos=[torch.from_numpy(array).permute(0, 3, 1, 2)], do_resize=True,
                                  do_sample_frames=False, return_tensors="pt")
            pixels, grids = ref["pixel_values_videos"], ref["video_grid_thw"]
        out[name] = {"shape": list(pixels.shape), "grids": grids.tolist(), "sha256": digest(pixels)}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    import sys
    record_digests(sys.argv[1])
