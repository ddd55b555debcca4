"""Images and video through the engine on the tiny vision checkpoint (fp32): greedy tokens equal
transformers' `generate` with the same pixels, through chunked prefill that cuts image spans,
preemption, and the prefix cache (the same image hits, another image with the same text does
not). Every test ends with the KV integrity check."""
import numpy as np
import pytest
import torch

from m3serve.llm import LLM
from m3serve.multimodal.inputs import expand_prompt, media_token_ids, process_multi_modal_data
from m3serve.multimodal.processor import ProcessorOptions
from m3serve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def image(width, height, seed):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def video(num_frames, seed):
    return np.random.default_rng(seed).integers(0, 256, (num_frames, 56, 84, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def hf_vl(tiny_vision_dir):
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(str(tiny_vision_dir), dtype=torch.float32).eval()


def hf_generate(hf, llm, prompt, data, n=10):
    """transformers' greedy continuation of the expanded prompt with the same pixels."""
    tok = llm.get_tokenizer()
    items = process_multi_modal_data(data, ProcessorOptions(), {"image": 99, "video": 99})
    ids = expand_prompt(tok.encode(prompt).ids, items, media_token_ids(tok.token_to_id))
    kwargs = {}
    images = [x for x in items if x.modality == "image"]
    videos = [x for x in items if x.modality == "video"]
    if images:
        kwargs["pixel_values"] = torch.cat([x.pixel_values for x in images])
        kwargs["image_grid_thw"] = torch.tensor([g for x in images for g in x.grids])
    if videos:
        kwargs["pixel_values_videos"] = torch.cat([x.pixel_values for x in videos])
        kwargs["video_grid_thw"] = torch.tensor([g for x in videos for g in x.grids])
    # an explicit mask: the tiny vocabulary's last id (what other tests pad with) is a marker here
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return ids, out[0, len(ids):].tolist()


def assert_all_blocks_free(llm):
    core = llm.engine.core
    assert not core.scheduler.has_unfinished_requests()
    core.scheduler.check_integrity()
    core.kv_manager.check_integrity()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_usable_blocks


CASES = {
    "one_image": ("look ]<]image[>[ and tell me", {"image": image(150, 100, 1)}),
    "two_images": ("first ]<]image[>[ then ]<]image[>[ compare", {"image": [image(60, 90, 2), image(130, 70, 3)]}),
    "video": ("watch ]<]video[>[ now", {"video": video(5, 4)}),
    "image_and_video": ("]<]video[>[ and ]<]image[>[", {"image": image(50, 50, 5), "video": video(3, 6)}),
}


@pytest.fixture(scope="module")
def expected(hf_vl, tiny_vision_dir):
    llm = LLM(model=str(tiny_vision_dir), dtype="float32")
    return {name: hf_generate(hf_vl, llm, *case) for name, case in CASES.items()}


@pytest.mark.parametrize("flags", [
    dict(),
    dict(max_num_batched_tokens=20),          # chunks cut through every image span
    dict(max_num_batched_tokens=48, kv_cache_memory=7 * 16 * 2944, async_scheduling=False),  # preemption
], ids=["batched", "chunked", "preempt"])
def test_greedy_equals_transformers(tiny_vision_dir, expected, flags):
    llm = LLM(model=str(tiny_vision_dir), dtype="float32", **flags)
    names = list(CASES)
    outs = llm.generate([{"prompt": CASES[n][0], "multi_modal_data": CASES[n][1]} for n in names],
                        GREEDY, use_tqdm=False)
    for name, out in zip(names, outs):
        ids, tokens = expected[name]
        assert out.prompt_token_ids == ids, name
        assert out.outputs[0].token_ids == tokens, name
    llm.engine.engine_states()                  # a step that tells the worker who finished
    assert llm.engine.worker.runner.media == {}         # media state dropped with the requests
    if "kv_cache_memory" in flags:
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_encoder_budget_spreads_images_over_steps(tiny_vision_dir, expected):
    """--max-num-encoder-input-tokens 10: the two images (6 and 10 placeholder tokens) are
    encoded in different steps (the chunk stops before the second), with the same answer; an
    image larger than the budget still runs, alone."""
    def encode_steps(budget, name):
        llm = LLM(model=str(tiny_vision_dir), dtype="float32", max_num_encoder_input_tokens=budget)
        runner, steps = llm.engine.worker.runner, []
        encoder = runner.vision
        runner.vision = lambda *a: steps.append(llm.engine.core.num_steps) or encoder(*a)
        out = llm.generate({"prompt": CASES[name][0], "multi_modal_data": CASES[name][1]}, GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected[name][1]
        assert_all_blocks_free(llm)
        return steps
    assert len(set(encode_steps(10, "two_images"))) == 2
    assert len(set(encode_steps(16, "two_images"))) == 1
    assert len(encode_steps(4, "one_image")) == 1          # 20 tokens, over the budget of 4


def test_encoder_runs_once_per_image_under_chunking(tiny_vision_dir):
    llm = LLM(model=str(tiny_vision_dir), dtype="float32", max_num_batched_tokens=16)
    runner = llm.engine.worker.runner
    calls = []
    encoder = runner.vision
    # one entry per image encoded (a step that reaches both encodes them in one forward)
    runner.vision = lambda pixels, grids: calls.extend(grids) or encoder(pixels, grids)
    llm.generate({"prompt": CASES["two_images"][0], "multi_modal_data": CASES["two_images"][1]},
                 GREEDY, use_tqdm=False)
    assert len(calls) == 2 and llm.engine.core.num_steps > 5


def test_prefix_cache_keys_include_the_image(tiny_vision_dir):
    """Same text, another image of the same size: no hit on the image's blocks and a different
    answer; the same image again: the blocks hit and the answer is the same."""
    llm = LLM(model=str(tiny_vision_dir), dtype="float32")
    text = "a long preamble that fills the first block of the cache ]<]image[>[ what is it"
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": image(112, 112, 10)}},
                         GREEDY, use_tqdm=False)[0]
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": image(112, 112, 11)}},
                         GREEDY, use_tqdm=False)[0]
    same = llm.generate({"prompt": text, "multi_modal_data": {"image": image(112, 112, 10)}},
                        GREEDY, use_tqdm=False)[0]
    assert first.prompt_token_ids == other.prompt_token_ids
    start = first.prompt_token_ids.index(media_token_ids(llm.get_tokenizer().token_to_id)["image"])
    # the blocks before the image are shared; none from the image's block on
    assert other.num_cached_tokens == start // 16 * 16
    assert same.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16 > start
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_bad_media_requests(tiny_vision_dir, tiny_dir):
    llm = LLM(model=str(tiny_vision_dir), dtype="float32", limit_mm_per_prompt='{"image": 1}')
    with pytest.raises(ValueError, match="2 ]<]image\\[>\\[ marker.*1 image"):
        llm.generate({"prompt": "]<]image[>[ ]<]image[>[", "multi_modal_data": {"image": image(30, 30, 1)}},
                     GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="too many images.*at most 1"):
        llm.generate({"prompt": "]<]image[>[ ]<]image[>[", "multi_modal_data": {"image": [image(30, 30, 1)] * 2}},
                     GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="0 ]<]image\\[>\\[ marker.*1 image"):
        llm.generate({"prompt": "no marker", "multi_modal_data": {"image": image(30, 30, 1)}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="no frames"):
        llm.generate({"prompt": "]<]video[>[", "multi_modal_data": {"video": np.zeros((0, 28, 28, 3), np.uint8)}},
                     GREEDY, use_tqdm=False)
    text_only = LLM(model=str(tiny_dir), dtype="float32")
    with pytest.raises(ValueError, match="without a vision tower"):
        text_only.generate({"prompt": "]<]image[>[", "multi_modal_data": {"image": image(30, 30, 1)}},
                           GREEDY, use_tqdm=False)
    skipped = LLM(model=str(tiny_vision_dir), dtype="float32", language_model_only=True)
    assert skipped.engine.worker.vision is None
    with pytest.raises(ValueError, match="without a vision tower"):
        skipped.generate({"prompt": "]<]image[>[", "multi_modal_data": {"image": image(30, 30, 1)}},
                         GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm)


def test_chat_with_image_parts_equals_generate(tiny_vision_dir):
    """LLM.chat with an image_url data URL and an image_pil part answers as generate does with
    the decoded images in the rendered prompt's marker positions."""
    from PIL import Image

    from media_samples import data_url, png_bytes
    from m3serve.multimodal.media import decode_image
    from m3serve.serving.chat_template import load_chat_template, render_chat
    llm = LLM(model=str(tiny_vision_dir), dtype="float32")
    second = Image.fromarray(image(70, 40, 9))
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what differs between"},
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(90, 60, seed=8))}},
        {"type": "text", "text": "and"}, {"type": "image_pil", "image_pil": second}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = render_chat(load_chat_template(tiny_vision_dir), messages)
    assert text.count("]<]image[>[") == 2
    ref = llm.generate({"prompt": text, "multi_modal_data": {"image": [decode_image(png_bytes(90, 60, seed=8)), second]}},
                       GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == ref.prompt_token_ids
    assert chat.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages\[0\].content\[1\]: corrupt or truncated"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {
            "url": data_url(png_bytes(200, 200)[:400])}}]}], GREEDY, use_tqdm=False)
