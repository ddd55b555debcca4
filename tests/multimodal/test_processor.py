"""Our image/video preprocessing against transformers 5.23's `minimax_m3_vl` processors:
the same pixel values (bit for bit) and grids for images of several shapes and a short video."""
import numpy as np
import pytest
import torch
from PIL import Image

from hf_vision import hf_processors
from m3serve.multimodal.processor import (ProcessorOptions, placeholder_parts, preprocess_image,
                                          preprocess_video, smart_resize)


@pytest.fixture(scope="module")
def hf():
    return hf_processors()


def random_image(width, height, seed, mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(array[..., 0] if channels == 1 else array, mode)


# non-square, tiny (below the minimum area), exactly the area bound, over it, grey, RGBA, tall
SIZES = [(150, 100, "RGB"), (20, 12, "RGB"), (672, 672, "RGB"), (1920, 1080, "RGB"),
         (333, 71, "L"), (97, 203, "RGBA"), (60, 900, "RGB")]


@pytest.mark.parametrize("width,height,mode", SIZES)
def test_image_equals_transformers(hf, width, height, mode):
    image = random_image(width, height, seed=width * height, mode=mode)
    ref = hf[0](images=[image], return_tensors="pt")
    ours = preprocess_image(image)
    assert ours.grids == [tuple(ref["image_grid_thw"][0].tolist())]
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert torch.equal(ours.pixel_values, ref["pixel_values"])
    assert ours.num_tokens == int(ref["image_grid_thw"][0].prod()) // 4


def test_max_pixels_option_equals_transformers(hf):
    """The HF processor's larger bound (1,003,520 pixels) through mm_processor_kwargs."""
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
    image = random_image(1920, 1080, seed=3)
    ref = MiniMaxM3VLImageProcessor(max_pixels=28 * 28 * 1280)(images=[image], return_tensors="pt")
    ours = preprocess_image(image, ProcessorOptions.from_kwargs({"max_pixels": 28 * 28 * 1280}))
    assert ours.grids == [tuple(ref["image_grid_thw"][0].tolist())]
    assert torch.equal(ours.pixel_values, ref["pixel_values"])
    assert ours.num_patches > preprocess_image(image).num_patches


@pytest.mark.parametrize("num_frames,segment", [(5, 4), (20, 4), (6, 2)])
def test_video_equals_transformers(hf, num_frames, segment):
    rng = np.random.default_rng(num_frames)
    frames = rng.integers(0, 256, (num_frames, 90, 130, 3), dtype=np.uint8)
    ref = hf[1](videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)], do_resize=True,
                do_sample_frames=False, vision_segment_max_frames=segment, return_tensors="pt")
    ours = preprocess_video(frames, ProcessorOptions.from_kwargs({"vision_segment_max_frames": segment}))
    assert ours.grids == [tuple(g) for g in ref["video_grid_thw"].tolist()]
    assert torch.equal(ours.pixel_values, ref["pixel_values_videos"])


def test_smart_resize_bounds():
    for h, w in [(1, 1), (20, 3000), (4000, 3000), (28, 28), (777, 1234)]:
        rh, rw = smart_resize(h, w, 3136, 451584)
        assert rh % 28 == 0 and rw % 28 == 0 and 3136 <= rh * rw <= 451584
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, 3136, 451584)
    with pytest.raises(ValueError, match="no pixels"):
        smart_resize(0, 30, 3136, 451584)


def test_bad_options_and_inputs():
    with pytest.raises(ValueError, match="unknown key"):
        ProcessorOptions.from_kwargs({"max_pixel": 5})
    with pytest.raises(ValueError, match="exceeds"):
        ProcessorOptions.from_kwargs({"min_pixels": 10**7})
    with pytest.raises(ValueError, match="no frames"):
        preprocess_video(np.zeros((0, 28, 28, 3), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        preprocess_image(np.zeros((28, 28, 3), np.float32))


def test_placeholder_expansion():
    """Spans as the HF processor writes them: one bracketed span per image, per temporal patch
    for a video, after a timestamp marker when the frame rate is known."""
    ids = {"image": 1, "video": 2, "image_start": 3, "image_end": 4}
    image = preprocess_image(random_image(100, 60, seed=1))
    assert placeholder_parts(image, ids) == [[3] + [1] * image.num_tokens + [4]]
    frames = np.zeros((5, 56, 84, 3), np.uint8)
    video = preprocess_video(frames, fps=2.0)
    assert video.grids == [(3, 4, 6)] and video.timestamps == [0.0, 1.0, 2.0]
    span = [3] + [2] * 6 + [4]
    assert placeholder_parts(video, ids) == ["]<]0.0 seconds[>[", span, "]<]1.0 seconds[>[", span,
                                             "]<]2.0 seconds[>[", span]


def test_equals_recorded_transformers_outputs():
    """Without torchvision (CI): our pixel values against digests of transformers' processors'
    outputs for seeded inputs, recorded with `python tests/multimodal/hf_vision.py FILE` where
    torchvision is installed (the tests above compare live there)."""
    import json
    from pathlib import Path

    from hf_vision import digest, digest_cases
    recorded = json.loads((Path(__file__).parent / "hf_processor_digests.json").read_text())
    assert set(recorded) == set(digest_cases())
    for name, (kind, array) in digest_cases().items():
        item = preprocess_image(array) if kind == "image" else preprocess_video(array)
        want = recorded[name]
        assert [list(g) for g in item.grids] == want["grids"], name
        assert list(item.pixel_values.shape) == want["shape"], name
        assert digest(item.pixel_values) == want["sha256"], name


def test_video_hash_covers_its_segments():
    """Frames cut into other segments attend otherwise, so their hash (the prefix-cache key)
    differs; the same cut hashes the same."""
    frames = np.random.default_rng(5).integers(0, 256, (8, 56, 56, 3), dtype=np.uint8)
    a, b, c = (preprocess_video(frames, ProcessorOptions.from_kwargs({"vision_segment_max_frames": s}))
               for s in (2, 2, 4))
    assert a.content_hash == b.content_hash != c.content_hash
