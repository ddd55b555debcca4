"""Quantised checkpoints (`make-tiny --quantization ...`): each format loads into packed
parameters where its config says and nowhere else; mutated files are refused with an error
naming the tensor; the weights the model holds decode to the source weights within the
format's bound (which a file with swapped nibbles fails); the packed weights and scales shard
over TP and EP ranks as the dense weights do; blocks that would straddle ranks are refused."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from m3serve.distributed import GroupInfo, ParallelInfo
from m3serve.layers.packed import dequantized, packed_format
from m3serve.model.formats import detect_scheme
from m3serve.model.formats.layouts import dequantized_checkpoint
from m3serve.model.loader import load_model
from m3serve.model.tiny import random_weights

FORMATS = ("mxfp8", "nvfp4-modelopt", "nvfp4-ct", "mxfp4-quark")
L = "language_model.model.layers."
# per fixture: the packed format of layer 3's (sparse, MoE) and layer 1's weights; None = dense
PACKED = {
    "mxfp8": dict(qkv="mxfp8", experts="mxfp8", shared="mxfp8", dense="mxfp8"),
    "nvfp4-modelopt": dict(qkv="mxfp8", experts="nvfp4-modelopt", shared="mxfp8", dense="mxfp8"),
    "nvfp4-ct": dict(qkv=None, experts="nvfp4", shared="nvfp4", dense="nvfp4"),
    "mxfp4-quark": dict(qkv=None, experts="mxfp4", shared="mxfp4", dense=None),
}
# the checkpoint's names for one expert linear's block scale and (NVFP4) global scale
SCALE_NAMES = {"mxfp8": ("weight_scale_inv", None), "nvfp4-modelopt": ("weight_scale", "weight_scale_2"),
               "nvfp4-ct": ("weight_scale", "weight_global_scale"), "mxfp4-quark": ("weight_scale", None)}
CODES = {"nvfp4-ct": "weight_packed"}


def load(path, **kw):
    return load_model(path, dtype="float32", progress=False, **kw)[0]


def name_of(m, attr):
    fmt = packed_format(m, attr)
    return fmt.name if fmt else None


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_loads_packed_where_its_config_says(quant_dir, fmt):
    model = load(quant_dir(fmt))
    l3, l1, l0 = model.model.layers[3], model.model.layers[1], model.model.layers[0]
    want = PACKED[fmt]
    assert name_of(l3.self_attn.qkv_proj, "weight") == want["qkv"]
    assert name_of(l3.mlp.experts, "w13") == want["experts"] == name_of(l3.mlp.experts, "w2")
    assert name_of(l3.mlp.shared_experts.down_proj, "weight") == want["shared"]
    assert name_of(l1.mlp.down_proj, "weight") == want["dense"]
    # the fixtures' exclusion lists name layer 0's down_proj: it stays dense
    assert name_of(l0.mlp.down_proj, "weight") is None and l0.mlp.down_proj.weight.dtype == torch.float32
    assert l3.mlp.gate.weight.dtype == torch.float32 and model.lm_head.weight.dtype == torch.float32
    if want["experts"].startswith("mx"):
        assert l3.mlp.experts.w13_block_scale.dtype == torch.uint8
        assert l3.mlp.experts.w13_block_scale.shape == (8, 256, 2)     # K = 64 -> 2 blocks of 32
    else:
        assert l3.mlp.experts.w13_block_scale.dtype == torch.float8_e4m3fn
        assert l3.mlp.experts.w13_block_scale.shape == (8, 256, 4)     # 4 blocks of 16
        assert l3.mlp.experts.w13_global_scale.shape == (8, 256)


def decode_error(model, cfg_seed=0):
    """max over layer 3's routed experts' w1 of |decoded - source| / the format's per-element
    bound, the bound taken from the source weights alone (each 32- or 16-block's amax), so that
    it holds whatever the checkpoint's scales say."""
    cfg = model.cfg
    src = random_weights(cfg, cfg_seed)
    ex = model.model.layers[3].mlp.experts
    kind = packed_format(ex, "w13").kind
    worst = 0.0
    for e in range(cfg.num_local_experts):
        w = dequantized(ex, "w13", torch.float32, index=e)[: cfg.intermediate_size]     # w1 rows
        s = src[f"model.layers.3.block_sparse_moe.experts.{e}.w1.weight"].float()
        block = 16 if kind == "nvfp4" else 32
        amax = s.view(s.shape[0], -1, block).abs().amax(-1).repeat_interleave(block, -1)
        if kind == "mxfp8":      # 3 mantissa bits; the scale is below 2 amax / 448, its subnormal step 2^-9 of it
            bound = s.abs() * 2 ** -4 + amax / 448 * 2 ** -8
        elif kind == "mxfp4":    # one scale unit; the unit is at most amax / 3.5
            bound = amax / 3.5
        else:                    # 1 + 6/16 units of (e4m3-rounded) amax / 6
            bound = amax / 6 * (1 + 1 / 16) * (1 + 6 / 16)
        worst = max(worst, ((w - s).abs() / bound).max().item())
    return worst


@pytest.mark.parametrize("fmt", FORMATS)
def test_held_weights_decode_to_the_source_within_the_bound(quant_dir, fmt):
    assert decode_error(load(quant_dir(fmt))) <= 1.0


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def hand_decode(t: dict, fixture: str, module: str) -> torch.Tensor:
    """One linear's weight from its checkpoint tensors by the formats' published rules, written
    out here: E2M1 low nibble first, E8M0 = 2^(e - 127), NVFP4 global scale divides
    (compressed-tensors) or multiplies (ModelOpt)."""
    block_name, global_name = SCALE_NAMES[fixture]
    q, scale = t[f"{module}.{CODES.get(fixture, 'weight')}"], t[f"{module}.{block_name}"]
    if fixture == "mxfp8":
        values, block = q.float(), 32
    else:
        codes = torch.stack([q & 15, q >> 4], -1).flatten(-2).long()
        values, block = E2M1[codes & 7] * (1 - 2 * (codes >> 3)).float(), (32 if fixture == "mxfp4-quark" else 16)
    scale = scale.float() if fixture.startswith("nvfp4") else 2.0 ** (scale.float() - 127)
    w = values * scale.repeat_interleave(block, -1)
    if fixture == "nvfp4-ct":
        w = w / t[f"{module}.{global_name}"]
    elif fixture == "nvfp4-modelopt":
        w = w * t[f"{module}.{global_name}"]
    return w


@pytest.mark.parametrize("fmt", FORMATS)
def test_files_decode_by_hand_to_the_source_and_to_what_the_model_holds(quant_dir, fmt):
    """The writer against the source weights and the reader against the file, both through
    the published rules above (not through the code under test)."""
    path = quant_dir(fmt)
    t = load_file(str(path / "model.safetensors"))
    model = load(path)
    src = random_weights(model.cfg, 0)
    ex = model.model.layers[3].mlp.experts
    w1 = "model.layers.3.block_sparse_moe.experts.5.w1"
    by_hand = hand_decode(t, fmt, "language_model." + w1)
    s = src[w1 + ".weight"].float()
    block = 16 if fmt.startswith("nvfp4") else 32
    amax = s.view(s.shape[0], -1, block).abs().amax(-1).repeat_interleave(block, -1)
    assert ((by_hand - s).abs() <= amax * 0.25).all()               # every format is closer than this
    assert ((by_hand - s).abs() > 0).any()
    held = dequantized(ex, "w13", torch.float32, index=5)[: model.cfg.intermediate_size]
    assert torch.allclose(held, by_hand, rtol=1e-6, atol=0)


def mutated(src, dst, change=None, config=None):
    """A copy of checkpoint `src` in `dst` with `change(tensors)` applied to its weights and
    `config(quantization_config)` to its config."""
    shutil.copytree(src, dst)
    if change is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        config(raw["quantization_config"])
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def swap_nibbles(t):
    return (t >> 4) | ((t & 0x0F) << 4)


@pytest.mark.parametrize("fmt", ["mxfp4-quark", "nvfp4-ct"])
def test_swapped_nibble_order_is_caught_numerically(quant_dir, tmp_path, fmt):
    """Nibble order cannot be seen in shapes or dtypes: a file written high nibble first loads,
    but its weights no longer decode to the source within the format's bound."""
    codes = CODES.get(fmt, "weight")

    def change(t):
        for e in range(8):
            key = f"{L}3.block_sparse_moe.experts.{e}.w1.{codes}"
            t[key] = swap_nibbles(t[key])
    bad = mutated(quant_dir(fmt), tmp_path / "swapped", change)
    assert decode_error(load(bad)) > 4.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_mutated_checkpoints_are_refused_by_name(quant_dir, tmp_path, fmt):
    src = quant_dir(fmt)
    block, glob = SCALE_NAMES[fmt]
    codes = CODES.get(fmt, "weight")
    w1 = f"{L}3.block_sparse_moe.experts.0.w1"
    down = f"{L}3.block_sparse_moe.shared_experts.down_proj"

    def drop(key):
        return lambda t: t.pop(key)

    def retype(key):
        return lambda t: t.__setitem__(key, t[key].float())

    def cut(key):
        return lambda t: t.__setitem__(key, t[key][:, :-1].contiguous())

    def add(key, like):
        return lambda t: t.__setitem__(key, t[like].clone())

    cases = [("missing", drop(f"{w1}.{block}"), rf"missing tensor\(s\) \['{w1}\.{block}'\]"),
             ("dtype", retype(f"{w1}.{block}"), rf"wrong dtype for tensor '{w1}\.{block}' in model\.safetensors"),
             ("shape", cut(f"{down}.{codes}"), rf"wrong shape for tensor '{down}\.{codes}' in model\.safetensors"),
             ("unexpected", add(f"{L}0.mlp.down_proj.{block}", f"{down}.{block}"),
              rf"unexpected tensor '{L}0\.mlp\.down_proj\.{block}' in model\.safetensors")]
    if glob:
        cases.append(("global", drop(f"{w1}.{glob}"), rf"missing tensor\(s\) \['{w1}\.{glob}'\]"))
        act = "input_scale" if fmt == "nvfp4-modelopt" else "input_global_scale"
        cases.append(("act", drop(f"{w1}.{act}"), rf"missing tensor\(s\) \['{w1}\.{act}'\]"))
        cases.append(("global-shape", lambda t: t.__setitem__(f"{w1}.{glob}", torch.ones(2)),
                      rf"wrong shape for tensor '{w1}\.{glob}'"))
    for label, change, message in cases:
        with pytest.raises(ValueError, match=message):
            load(mutated(src, tmp_path / label, change))


def test_config_errors_name_the_key(quant_dir, tmp_path):
    src = quant_dir("mxfp4-quark")
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method: unsupported value 'gptq' "
                                         r"\(supported: mxfp8, modelopt, compressed-tensors, quark\)"):
        load(mutated(src, tmp_path / "a", config=lambda q: q.update(quant_method="gptq")))
    with pytest.raises(ValueError, match=r"global_quant_config\.weight\.group_size: unsupported value 16"):
        load(mutated(src, tmp_path / "b", config=lambda q: q["global_quant_config"]["weight"].update(group_size=16)))
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.weights\.group_size: unsupported value 32"):
        detect_scheme({"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                                   "num_bits": 4, "type": "float", "group_size": 32}}}}})
    with pytest.raises(ValueError, match=r"quant_algo 'FP8'"):
        detect_scheme({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}})
    with pytest.raises(ValueError, match=r"moe_quant_algo / moe_quant_format: unsupported values 'MXFP4'"):
        detect_scheme({"quantization_config": {"quant_method": "mxfp8", "moe_quant_algo": "MXFP4"}})
    with pytest.raises(ValueError, match="already quantised"):
        load(src, quantization="fp8")


def test_fused_parts_in_different_formats_are_refused(quant_dir, tmp_path):
    """q/k/v/index projections are one weight: a config quantising only some is refused."""
    bad = mutated(quant_dir("mxfp8"), tmp_path / "mixed",
                  config=lambda q: q["ignored_layers"].append(f"{L}3.self_attn.index_k_proj"))
    with pytest.raises(ValueError, match=r"qkv_proj\.weight in different formats .*index_k_proj: unquantised"):
        load(bad)


def test_blocks_straddling_ranks_are_refused(tiny_dir):
    """The default tiny model's dense MLP is 96 wide: at TP 2 each rank's down_proj has K = 48,
    which 32-blocks would straddle."""
    from m3serve.layers.linear import deferred_weights
    from m3serve.layers.packed import MXFP8
    from m3serve.model.config import load_config
    from m3serve.model.loader import pack_model_
    from m3serve.model.minimax_m3 import MiniMaxM3ForCausalLM
    cfg = load_config(tiny_dir)
    with deferred_weights():
        net = MiniMaxM3ForCausalLM(cfg, ParallelInfo(GroupInfo(0, 2)), torch.float32)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: mxfp8 scale blocks of 32 .* "
                                         r"this rank's K is 48 \(input size 96 split over TP 2\)"):
        pack_model_(net, cfg, lambda m: MXFP8)


@pytest.mark.parametrize("fmt,tp,ep", [("nvfp4-ct", 2, False), ("mxfp4-quark", 4, False),
                                       ("mxfp8", 2, False), ("nvfp4-modelopt", 2, True)])
def test_packed_shards_reassemble(quant_dir, fmt, tp, ep):
    """Each rank's packed weights, decoded, are its slice of the whole decoded weight: rows of
    column-parallel layers, K columns of row-parallel ones and of the experts' w2, whole
    experts under expert parallelism."""
    path = quant_dir(fmt)
    full = dequantized_checkpoint(path)
    ranks = [load(path, parallel=ParallelInfo(GroupInfo(r, tp), enable_expert_parallel=ep)) for r in range(tp)]
    cfg = ranks[0].cfg
    I, E, S = cfg.intermediate_size, cfg.num_local_experts, cfg.shared_intermediate_size
    m = "model.layers.3.block_sparse_moe."
    for r, model in enumerate(ranks):
        layer = model.model.layers[3]
        ex = layer.mlp.experts
        for i in range(ex.num_local):
            e = ex.first + i
            w13, w2 = dequantized(ex, "w13", torch.float32, i), dequantized(ex, "w2", torch.float32, i)
            cols = slice(0, I) if ep else slice(r * I // tp, (r + 1) * I // tp)
            want13 = torch.cat([full[f"{m}experts.{e}.w1.weight"][cols], full[f"{m}experts.{e}.w3.weight"][cols]])
            assert torch.equal(w13, want13) and torch.equal(w2, full[f"{m}experts.{e}.w2.weight"][:, cols])
        assert ex.num_local == (E // tp if ep else E)
        sh = layer.mlp.shared_experts
        cols = slice(r * S // tp, (r + 1) * S // tp)
        assert torch.equal(dequantized(sh.down_proj, "weight", torch.float32),
                           full[f"{m}shared_experts.down_proj.weight"][:, cols])
        assert torch.equal(dequantized(sh.gate_up_proj, "weight", torch.float32),
                           torch.cat([full[f"{m}shared_experts.gate_proj.weight"][cols],
                                      full[f"{m}shared_experts.up_proj.weight"][cols]]))
        o = slice(r * 128 // tp, (r + 1) * 128 // tp)
        assert torch.equal(dequantized(layer.self_attn.o_proj, "weight", torch.float32),
                           full["model.layers.3.self_attn.o_proj.weight"][:, o])


# one routed expert linear's tensors in each release layout (docs/model.md §8): suffix -> (dtype, shape)
RELEASE_LAYOUT = {
    "mxfp8": {"weight": ("F8_E4M3", [128, 64]), "weight_scale_inv": ("U8", [128, 2])},
    "nvfp4-modelopt": {"weight": ("U8", [128, 32]), "weight_scale": ("F8_E4M3", [128, 4]),
                       "weight_scale_2": ("F32", []), "input_scale": ("F32", [])},
    "nvfp4-ct": {"weight_packed": ("U8", [128, 32]), "weight_scale": ("F8_E4M3", [128, 4]),
                 "weight_global_scale": ("F32", [1]), "input_global_scale": ("F32", [1])},
    "mxfp4-quark": {"weight": ("U8", [128, 32]), "weight_scale": ("U8", [128, 2])},
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_fixture_files_have_the_release_layout_and_are_stable(quant_dir, tmp_path, fmt):
    from safetensors import safe_open

    from m3serve.model.tiny import make_tiny
    path = quant_dir(fmt)
    w1 = f"{L}3.block_sparse_moe.experts.0.w1."
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        got = {k[len(w1):]: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape())
               for k in f.keys() if k.startswith(w1)}
        assert f.get_slice(f"{L}3.block_sparse_moe.gate.weight").get_dtype() == "F32"
        assert f.get_slice("language_model.lm_head.weight").get_dtype() == "BF16"
    assert got == RELEASE_LAYOUT[fmt]
    again = make_tiny(tmp_path / "again", seed=0, quantization=fmt)
    other = make_tiny(tmp_path / "other", seed=1, quantization=fmt)
    for name in ("model.safetensors", "config.json"):
        assert (again / name).read_bytes() == (path / name).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (path / "model.safetensors").read_bytes()


def test_m31_flash_fixture_mixed_layout(quant_dir):
    """`make-tiny --flavor m3.1-flash --quantization mxfp8-nvfp4`, M3.1-Flash's layout
    (`quant_method: mxfp8` + `moe_quant_algo: NVFP4`, `moe_quant_format: nvfp4-pack-quantized`):
    routed experts in compressed-tensors NVFP4, everything else MXFP8, index projections in every
    (MSA) layer; the served logits equal the reference's on the dequantised weights."""
    from m3serve.model.reference import ReferenceM3
    from paged import PagedRunner

    path = quant_dir("mxfp8-nvfp4", "m3.1-flash")
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    assert raw["moe_quant_algo"] == "NVFP4" and raw["moe_quant_format"] == "nvfp4-pack-quantized"
    t = load_file(str(path / "model.safetensors"))
    assert f"{L}0.self_attn.index_q_proj.weight_scale_inv" in t
    assert t[f"{L}3.block_sparse_moe.experts.0.w1.weight_packed"].dtype == torch.uint8
    model = load(path)
    assert all(model.cfg.is_sparse(i) for i in range(model.cfg.num_hidden_layers))
    layer = model.model.layers[3]
    assert name_of(layer.mlp.experts, "w13") == "nvfp4" and name_of(layer.self_attn.qkv_proj, "weight") == "mxfp8"
    assert name_of(layer.mlp.shared_experts.gate_up_proj, "weight") == "mxfp8"
    assert name_of(model.model.layers[0].self_attn.qkv_proj, "weight") == "mxfp8"
    ids = torch.randint(0, 2000, (90,), generator=torch.Generator().manual_seed(4))
    ref, _ = ReferenceM3(model.cfg, dequantized_checkpoint(path)).forward(ids)
    runner = PagedRunner(model, seed=1)
    logits = torch.cat([runner.step({0: ids[:50].tolist()}), runner.step({0: ids[50:].tolist()})])
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()