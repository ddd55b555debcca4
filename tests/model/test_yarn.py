"""YaRN RoPE (rope_type "yarn", how MiniMax-M3 recipes reach long contexts through
--hf-overrides) against transformers: the frequencies and scale, and the model's logits."""
import json
import shutil

import pytest
import torch

from m3serve.layers.rotary import RotaryEmbedding
from m3serve.model.config import load_config
from m3serve.model.loader import load_model
from paged import PagedRunner

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def yarn_dir(hf_dir, tmp_path, rope: dict):
    d = tmp_path / "yarn"
    shutil.copytree(hf_dir, d)
    config = json.loads((d / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], **rope}
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("rope", [YARN, {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
                                  {**YARN, "mscale": 0.8, "mscale_all_dim": 0.5}])
def test_frequencies_and_scale_match_transformers(hf_checkpoints, tmp_path, rope):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    _, hf_dir, _ = hf_checkpoints
    d = yarn_dir(hf_dir, tmp_path, rope)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(str(d)))
    cfg = load_config(d)
    ours = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_yarn)
    assert torch.allclose(ours.inv_freq, ref_inv.float(), rtol=1e-6, atol=0)
    assert ours.scale == pytest.approx(ref_scale, rel=1e-9)


def test_logits_match_transformers_and_the_override_path(hf_checkpoints, tmp_path):
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM
    _, hf_dir, _ = hf_checkpoints
    d = yarn_dir(hf_dir, tmp_path, YARN)
    hf = MiniMaxM3VLForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ids = torch.randint(0, 2000, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    scale = ref.abs().max()
    ours, _, _ = load_model(d, dtype="float32", progress=False)
    assert (PagedRunner(ours).step({0: ids}) - ref).abs().max() <= 1e-4 * scale
    # the same through --hf-overrides on the plain checkpoint (rope_scaling, as recipes write it)
    over, _, _ = load_model(hf_dir, dtype="float32", progress=False, hf_overrides={"rope_scaling": YARN})
    assert (PagedRunner(over).step({0: ids}) - ref).abs().max() <= 1e-4 * scale
    # and YaRN changes these logits: plain RoPE would not pass the check above
    plain, _, _ = load_model(hf_dir, dtype="float32", progress=False)
    assert (PagedRunner(plain).step({0: ids}) - ref).abs().max() > 1e-2 * scale
