"""Prompt ids of requests with images and videos against transformers 5.23's
`MiniMaxM3VLProcessor`: its own marker expansion and tokenization (`__call__` with the image and
video processors replaced by stubs that return our grids and frame metadata, so no torchvision
is needed), on the tiny tokenizer with merges added across the timestamp markers' boundary."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from m3serve.model.tokenizer_build import STORED_TOKENIZER
from m3serve.multimodal.inputs import expand_prompt, media_token_ids
from m3serve.multimodal.processor import preprocess_image, preprocess_video

# BPE merges that join a timestamp marker's first character with the text before it
BOUNDARY_MERGES = [("Ġ", "]"), (".", "]"), (":", "]")]


@pytest.fixture(scope="module")
def tokenizer():
    spec = json.loads(STORED_TOKENIZER.read_text())
    vocab = spec["model"]["vocab"]
    for a, b in BOUNDARY_MERGES:
        vocab[a + b] = len(vocab)
        spec["model"]["merges"].append([a, b])
    for i, token in enumerate(spec["added_tokens"]):      # the added tokens follow the vocab
        token["id"] = len(vocab) + i
    return Tokenizer.from_str(json.dumps(spec))


class _Stub:
    """An image or video processor returning fixed outputs (the pixels are not compared here)."""
    merge_size, temporal_patch_size = 2, 2

    def __init__(self, outputs):
        self.outputs = outputs

    def __call__(self, *args, **kwargs):
        from transformers import BatchFeature
        return BatchFeature(dict(self.outputs))

    def fetch_images(self, images):
        return images


def reference_ids(tokenizer, prompt, items, frame_counts, fps):
    from transformers import PreTrainedTokenizerFast
    from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
    processor = MiniMaxM3VLProcessor.__new__(MiniMaxM3VLProcessor)   # no subprocessor type checks
    processor.tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    processor.image_token, processor.video_token = processor.IMAGE_TOKEN, processor.VIDEO_TOKEN
    images = [x for x in items if x.modality == "image"]
    videos = [x for x in items if x.modality == "video"]
    processor.image_processor = _Stub({"image_grid_thw": torch.tensor([g for x in images for g in x.grids])})
    metadata = [SimpleNamespace(fps=f, frames_indices=list(range(n)) if f else None)
                for n, f in zip(frame_counts, fps)]
    processor.video_processor = _Stub({"video_grid_thw": torch.tensor([g for x in videos for g in x.grids]),
                                       "num_chunks_per_video": [len(x.grids) for x in videos],
                                       "video_metadata": metadata})
    out = processor(text=prompt, images=[np.zeros((28, 28, 3), np.uint8)] * len(images) or None,
                    videos=[np.zeros((n, 28, 28, 3), np.uint8) for n in frame_counts] or None)
    return out["input_ids"][0]


def _items(num_images, frame_counts, fps):
    images = [preprocess_image(np.full((60 + 28 * i, 90, 3), 40 * i, np.uint8)) for i in range(num_images)]
    videos = [preprocess_video(np.zeros((n, 56, 84, 3), np.uint8), fps=f) for n, f in zip(frame_counts, fps)]
    return images + videos


IMG, VID = "]<]image[>[", "]<]video[>["
PLACEMENTS = [
    (f"{VID} first", 0, [3], [2.0]),
    (f"Describe this video: {VID}", 0, [5], [2.0]),
    (f"Watch it. {VID} What happens?", 0, [4], [1.0]),
    (f"See.{VID}and{VID}", 0, [3, 2], [2.0, 0.5]),
    (f"two at once:{VID}{VID}", 0, [3, 4], [1.0, 3.0]),
    (f"a long one: {VID}", 0, [11], [4.0]),                  # 6 temporal patches: 2 segments
    (f"no rate: {VID} then {IMG}.", 1, [3], [None]),
    (f"]~b]user: {IMG} and {VID} ]<]minimax[>[ {VID}", 1, [2, 5], [2.0, 1.0]),
    (f"image then video:{IMG}{VID} end", 1, [3], [2.0]),
    (f"{IMG} {IMG} images only. ", 2, [], []),
]


@pytest.mark.parametrize("prompt,num_images,frame_counts,fps", PLACEMENTS)
def test_expansion_equals_reference_processor(tokenizer, prompt, num_images, frame_counts, fps):
    items = _items(num_images, frame_counts, fps)
    want = reference_ids(tokenizer, prompt, items, frame_counts, fps)
    ids = media_token_ids(tokenizer.token_to_id)
    got = expand_prompt(tokenizer.encode(prompt).ids, items, ids, tokenizer)
    assert got == want


def test_the_tokenizer_merges_across_the_marker(tokenizer):
    """Guards the test above: tokenizing each timestamp marker on its own gives other ids here."""
    prompt = f"Describe this video: {VID}"
    items = _items(0, [3], [2.0])
    want = reference_ids(tokenizer, prompt, items, [3], [2.0])
    ids = media_token_ids(tokenizer.token_to_id)
    separate = tokenizer.encode("Describe this video: ").ids
    for i, t in enumerate(items[0].timestamps):
        separate += tokenizer.encode(f"]<]{t:.1f} seconds[>[").ids
        separate += [ids["image_start"]] + [ids["video"]] * items[0].tokens_per_frame + [ids["image_end"]]
    assert separate != want and len(separate) == len(want) + 1


def test_offline_path_expands_like_the_reference(tokenizer):
    """`LLM.encode_media` (the offline API) gives the reference's ids for a video with a frame rate."""
    from m3serve.llm import LLMEngine
    from m3serve.multimodal.processor import ProcessorOptions
    prompt = f"Describe this video: {VID}"
    frames = np.zeros((3, 56, 84, 3), np.uint8)
    items = _items(0, [3], [2.0])
    llm = SimpleNamespace(tokenizer=tokenizer, mm_options=ProcessorOptions(),
                          config=SimpleNamespace(model=SimpleNamespace(limit_mm_per_prompt={"video": 1},
                                                                       max_model_len=10_000)),
                          model_config=None)
    got, inputs = LLMEngine.encode_media(llm, {"prompt": prompt, "multi_modal_data": {"video": {"frames": frames, "fps": 2.0}}},
                                   tokenizer.encode(prompt).ids)
    assert got == reference_ids(tokenizer, prompt, items, [3], [2.0]) and len(inputs) == 1


def test_ids_spelling_an_added_token_are_refused(tokenizer):
    pieces = [i for t in "]<]image[>[" for i in tokenizer.encode(t).ids]
    ids = media_token_ids(tokenizer.token_to_id)
    with pytest.raises(ValueError, match="special token"):
        expand_prompt(pieces + [ids["video"]], _items(0, [2], [1.0]), ids, tokenizer)
