"""The vision tower, projector and merge MLP against transformers 5.23's `minimax_m3_vl` on the
tiny checkpoint's random vision weights (fp32): features for images of several shapes and a
short video, and the strict loader's errors."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from m3serve.model.config import load_config
from m3serve.model.loader import load_vision_encoder
from m3serve.multimodal.processor import ProcessorOptions, preprocess_image, preprocess_video


@pytest.fixture(scope="module")
def hf_vl(tiny_vision_dir):
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(str(tiny_vision_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def encoder(tiny_vision_dir):
    cfg = load_config(tiny_vision_dir)
    return load_vision_encoder(cfg, tiny_vision_dir, torch.float32)


def hf_features(hf, item):
    grid = torch.tensor(item.grids)
    with torch.no_grad():
        out = hf.model.get_image_features(item.pixel_values, grid, return_dict=True)
    return torch.cat(out.pooler_output)


def image(width, height, seed):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("width,height", [(150, 100), (20, 12), (672, 672), (60, 300)])
def test_image_features_equal_transformers(hf_vl, encoder, width, height):
    item = preprocess_image(image(width, height, seed=width + height))
    ours = encoder(item.pixel_values, item.grids)
    ref = hf_features(hf_vl, item)
    assert ours.shape == ref.shape == (item.num_tokens, 64)
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_video_features_equal_transformers(hf_vl, encoder):
    """Segments of at most 2 temporal patches: attention (and the temporal RoPE index) restart
    in every segment, so a wrong split changes the features."""
    frames = np.random.default_rng(5).integers(0, 256, (9, 60, 90, 3), dtype=np.uint8)
    item = preprocess_video(frames, ProcessorOptions(vision_segment_max_frames=2))
    assert item.grids == [(2, 4, 6), (2, 4, 6), (1, 4, 6)]
    ours = encoder(item.pixel_values, item.grids)
    ref = hf_features(hf_vl, item)
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()
    one_segment = encoder(item.pixel_values, [(5, 4, 6)])
    assert (one_segment - ref).abs().max() > 1e-3 * ref.abs().max()


def test_loader_accepts_transformers_names(hf_vl, tiny_vision_dir, tmp_path, encoder):
    """A checkpoint in transformers' names (save_pretrained of the text+vision state dict under
    `model.vision_tower.*`, `model.multi_modal_projector.merge_linear_*`) loads to the same tower."""
    state = {k: v.contiguous() for k, v in hf_vl.state_dict().items()
             if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    text = load_file(str(tiny_vision_dir / "model.safetensors"))
    text = {k: v for k, v in text.items() if k.startswith("language_model.")}
    save_file({**text, **state}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_vision_dir / "config.json").read_text())
    other = load_vision_encoder(load_config(tmp_path), tmp_path, torch.float32)
    for (name, a), (_, b) in zip(encoder.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_loader_is_strict(tiny_vision_dir, tmp_path):
    weights = load_file(str(tiny_vision_dir / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_vision_dir / "config.json").read_text())
    cfg = load_config(tmp_path)
    missing = {k: v for k, v in weights.items() if "patch_merge_mlp.linear_2.bias" not in k}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor.*patch_merge_mlp.linear_2.bias"):
        load_vision_encoder(cfg, tmp_path, torch.float32)
    extra = dict(weights, **{"vision_tower.vision_model.post_layernorm.weight": torch.ones(40)})
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor 'vision_tower.vision_model.post_layernorm.weight'"):
        load_vision_encoder(cfg, tmp_path, torch.float32)
    bad = dict(weights, **{"multi_modal_projector.linear_1.weight": torch.zeros(64, 41)})
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="wrong shape.*multi_modal_projector.linear_1.weight"):
        load_vision_encoder(cfg, tmp_path, torch.float32)


def test_text_only_checkpoint_has_no_encoder(tiny_dir):
    assert load_vision_encoder(load_config(tiny_dir), tiny_dir, torch.float32) is None
    assert json.loads((tiny_dir / "config.json").read_text())["image_token_index"] == 200025


@pytest.mark.gpu
def test_bf16_gpu_encoder_matches_float32_reference():
    """The GPU encoder (bf16, one variable-length flash call over images of four sizes and a video
    segment) against the float32 encoder on the CPU, the one equal to transformers: cosine per
    output token >= 0.999, and the varlen attention equal to the per-size SDPA calls."""
    import m3serve.envs as envs
    from m3serve.bench.vision import _random_
    from m3serve.model.vision import VisionEncoder, parse_vision_config
    cfg = parse_vision_config({"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 4,
                               "num_attention_heads": 16, "patch_size": 14}, 6144, 3072)
    ref = VisionEncoder(cfg, torch.float32)
    _random_(ref, 0)
    fast = VisionEncoder(cfg, torch.bfloat16)
    fast.load_state_dict(ref.state_dict())
    fast = fast.cuda().eval()
    items = [preprocess_image(image(w, h, s)) for s, (w, h) in enumerate([(672, 672), (300, 200), (1280, 720), (56, 56)])]
    items.append(preprocess_video(np.random.default_rng(9).integers(0, 256, (4, 112, 168, 3), dtype=np.uint8)))
    pixels = torch.cat([it.pixel_values for it in items])
    grids = [g for it in items for g in it.grids]
    want = ref(pixels, grids)
    got = fast(pixels.cuda(), grids).float().cpu()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert float(cos.min()) >= 0.999, float(cos.min())
    envs.VISION_ATTENTION = "runs"
    try:
        runs = fast(pixels.cuda(), grids).float().cpu()
    finally:
        envs.VISION_ATTENTION = "varlen"
    assert float(torch.nn.functional.cosine_similarity(got, runs, dim=-1).min()) >= 0.9999


def test_dummy_load_format_builds_a_random_vision_tower(tiny_vision_dir):
    """`--load-format dummy` on a config with a vision tower serves images with random vision
    weights (as the text weights are random), the same for the same seed; so real-shape benches
    with images need no vision tensors on disk."""
    from m3serve.llm import LLM
    from m3serve.model.loader import dummy_vision_encoder
    from m3serve.sampling_params import SamplingParams
    cfg = load_config(tiny_vision_dir)
    a, b = (dummy_vision_encoder(cfg, torch.float32, "cpu", seed=3) for _ in range(2))
    c = dummy_vision_encoder(cfg, torch.float32, "cpu", seed=4)
    item = preprocess_image(image(60, 90, 1))
    fa, fb, fc = (e(item.pixel_values, item.grids) for e in (a, b, c))
    assert torch.isfinite(fa).all() and fa.abs().max() > 0
    assert torch.equal(fa, fb) and not torch.equal(fa, fc)
    llm = LLM(model=str(tiny_vision_dir), load_format="dummy", dtype="float32", device="cpu")
    out = llm.generate([{"prompt": "see ]<]image[>[", "multi_modal_data": {"image": image(60, 90, 1)}}],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
