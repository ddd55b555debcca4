"""The checkpoint's processor configuration (transformers 5.23's `processor_config.json`, older
`preprocessor_config.json` / `video_preprocessor_config.json`) read into the preprocessing's
options, refused where it cannot be honoured, with `mm_processor_kwargs` on top."""
import json

import numpy as np
import pytest

from m3serve.multimodal.processor import ProcessorOptions, preprocess_image, preprocess_video
from m3serve.multimodal.processor_config import load_processor_settings


def write(directory, name, data):
    (directory / name).write_text(json.dumps(data))


NESTED = {"image_processor": {"image_processor_type": "MiniMaxM3VLImageProcessor", "patch_size": 14,
                              "merge_size": 2, "temporal_patch_size": 2, "resample": 3,
                              "image_mean": [0.48145466, 0.4578275, 0.40821073],
                              "size": {"shortest_edge": 56 * 56, "longest_edge": 448 * 448}},
          "video_processor": {"video_processor_type": "MiniMaxM3VLVideoProcessor", "min_pixels": 28 * 28 * 8,
                              "max_pixels": 28 * 28 * 16, "vision_segment_max_frames": 2,
                              "do_sample_frames": False, "fps": 2.0}}


def test_processor_config_json(tmp_path):
    write(tmp_path, "processor_config.json", NESTED)
    settings = load_processor_settings(tmp_path)
    assert settings == {"min_pixels": 56 * 56, "max_pixels": 448 * 448, "video_min_pixels": 28 * 28 * 8,
                        "video_max_pixels": 28 * 28 * 16, "vision_segment_max_frames": 2}
    options = ProcessorOptions(**settings)
    image = preprocess_image(np.zeros((672, 672, 3), np.uint8), options)
    assert image.grids == [(1, 32, 32)]                      # 448 x 448, not the default 672 x 672
    video = preprocess_video(np.zeros((10, 280, 280, 3), np.uint8), options)
    assert video.grids == [(2, 8, 8), (2, 8, 8), (1, 8, 8)]  # 112 x 112 frames, segments of 2


def test_legacy_files(tmp_path):
    write(tmp_path, "preprocessor_config.json", {"size": {"shortest_edge": 3136, "longest_edge": 1_000_000},
                                                 "max_pixels": 336 * 336})
    write(tmp_path, "video_preprocessor_config.json", {"max_pixels": 28 * 28 * 100})
    settings = load_processor_settings(tmp_path)
    assert settings["max_pixels"] == 336 * 336                # top-level max_pixels overrides size
    assert settings["video_max_pixels"] == 28 * 28 * 100
    (tmp_path / "video_preprocessor_config.json").unlink()    # the video processor falls back to it
    write(tmp_path, "preprocessor_config.json", {"min_pixels": 28 * 28 * 8})
    assert load_processor_settings(tmp_path)["video_min_pixels"] == 28 * 28 * 8


def test_processor_config_json_wins(tmp_path):
    write(tmp_path, "processor_config.json", NESTED)
    write(tmp_path, "preprocessor_config.json", {"size": {"shortest_edge": 1, "longest_edge": 2}})
    assert load_processor_settings(tmp_path)["max_pixels"] == 448 * 448


def test_stale_default_size_and_no_files(tmp_path):
    assert load_processor_settings(tmp_path) == ProcessorOptions().__dict__
    write(tmp_path, "preprocessor_config.json", {"size": [672, 672]})
    assert load_processor_settings(tmp_path) == ProcessorOptions().__dict__


@pytest.mark.parametrize("section,field,value,match", [
    ("image_processor", "patch_size", 16, r"image_processor\.patch_size: 16 is not supported"),
    ("video_processor", "merge_size", 3, r"video_processor\.merge_size: 3"),
    ("video_processor", "temporal_patch_size", 1, r"video_processor\.temporal_patch_size"),
    ("image_processor", "image_mean", [0.5, 0.5, 0.5], r"image_processor\.image_mean"),
    ("image_processor", "do_normalize", False, r"image_processor\.do_normalize"),
    ("video_processor", "do_sample_frames", True, r"video_processor\.do_sample_frames"),
    ("video_processor", "vision_segment_max_frames", None, r"video_processor\.vision_segment_max_frames"),
    ("video_processor", "max_pixels", -5, r"video_processor\.max_pixels: expected a positive integer"),
    ("image_processor", "size", {"longest_edge": 1000}, r"image_processor\.size: expected"),
    ("image_processor", "size", {"shortest_edge": 9000, "longest_edge": 5000}, r"min_pixels \(9000\) exceeds"),
])
def test_refused_values_name_file_and_field(tmp_path, section, field, value, match):
    config = json.loads(json.dumps(NESTED))
    config[section][field] = value
    write(tmp_path, "processor_config.json", config)
    with pytest.raises(ValueError, match=r"processor_config\.json: .*" + match):
        load_processor_settings(tmp_path)


def test_overrides_on_top(tmp_path):
    """--mm-processor-kwargs over the checkpoint's, a request's over both (the API process)."""
    from tokenizers import Tokenizer

    from m3serve.model.tokenizer_build import STORED_TOKENIZER
    from m3serve.multimodal.media import MediaPolicy
    from m3serve.serving.media_front import MediaFront
    write(tmp_path, "processor_config.json", NESTED)
    front = MediaFront(Tokenizer.from_file(str(STORED_TOKENIZER)), MediaPolicy(), {"image": 1},
                       processor_kwargs={"video_max_pixels": 28 * 28 * 32},
                       base_settings=load_processor_settings(tmp_path))
    try:
        options = front.options({"vision_segment_max_frames": 3})
    finally:
        front.close()
    assert (options.max_pixels, options.video_max_pixels, options.vision_segment_max_frames) == \
        (448 * 448, 28 * 28 * 32, 3)
