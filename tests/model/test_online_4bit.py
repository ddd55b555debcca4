"""Online `--quantization mxfp4 | nvfp4 | mxfp8` of a BF16 checkpoint: the routed and shared experts
(and, for mxfp8, every linear layer) are held packed, within the format's round-trip bound of the
checkpoint's weights,
and the served greedy tokens equal the dense reference's on the round-tripped weights."""
import pytest
import torch

from m3serve.distributed import GroupInfo, ParallelInfo
from m3serve.kernels.ref.packed import dequantize, e8m0_to_float
from m3serve.layers.packed import MXFP4, MXFP8, NVFP4, dequantized, packed_format
from m3serve.llm import LLM
from m3serve.model.loader import load_model
from m3serve.model.quantize import quantize_packed
from test_quant_e2e import assert_reference_greedy, serve
from refgreedy import canonical_weights

FORMATS = {"mxfp4": MXFP4, "nvfp4": NVFP4}


def round_trip(w: torch.Tensor, fmt) -> torch.Tensor:
    codes, scales, glob = quantize_packed(w, fmt)
    return dequantize(fmt.kind, codes, scales, glob, fmt.global_divides)


def is_expert_weight(name: str) -> bool:
    return ".block_sparse_moe.experts." in name or ".shared_experts." in name


@pytest.mark.parametrize("q", list(FORMATS))
def test_online_4bit_experts(tiny_dir, q):
    fmt = FORMATS[q]
    model = load_model(tiny_dir, dtype="float32", progress=False, quantization=q)[0]
    source = canonical_weights(tiny_dir)
    layer = model.model.layers[3]
    ex = layer.mlp.experts
    assert packed_format(ex, "w13") is fmt and packed_format(layer.mlp.shared_experts.gate_up_proj, "weight") is fmt
    assert packed_format(layer.self_attn.qkv_proj, "weight") is None                    # attention stays
    assert packed_format(model.model.layers[0].mlp.gate_up_proj, "weight") is None      # dense MLP stays
    I = ex.inter
    for e in range(ex.num_local):
        w = source[f"model.layers.3.block_sparse_moe.experts.{e}.w2.weight"]
        held = dequantized(ex, "w2", torch.float32, index=e)
        if q == "mxfp4":       # one scale unit at most
            bound = e8m0_to_float(ex.w2_block_scale[e]).repeat_interleave(32, -1)
        else:                  # half the widest E2M1 gap plus the e4m3 rounding of the block scale
            bound = (ex.w2_block_scale[e].float() / ex.w2_global_scale[e, :, None]).repeat_interleave(16, -1) * (1 + 6 / 16)
        assert ((held - w).abs() <= bound).all()
        assert (held - w).abs().max() > 0                                             # it was quantised
        assert held.shape == (64, I)

    llm = LLM(model=str(tiny_dir), dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, quantization=q)
    served = serve(llm)
    weights = {n: (round_trip(w, fmt) if is_expert_weight(n) else w) for n, w in source.items()}
    assert_reference_greedy(weights, llm.engine.model_config, served)


def test_online_4bit_refuses_straddling_blocks(tiny_dir):
    """The tiny model's experts are 32 wide: at TP 2 each rank's w2 has K = 16."""
    with pytest.raises(ValueError, match=r"experts\.w2: mxfp4 scale blocks of 32 .* this rank's K is 16 "
                                         r"\(intermediate_size 32 split 2 ways\)"):
        load_model(tiny_dir, dtype="float32", progress=False, quantization="mxfp4",
                   parallel=ParallelInfo(GroupInfo(0, 2)))


LINEAR_PARTS = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")


def test_online_mxfp8_every_linear(tiny_dir):
    """`--quantization mxfp8` holds every linear layer and the routed experts as MXFP8 codes
    (what the MXFP8 release quantises: not the embedding, lm_head, router or norms), and the
    served greedy tokens equal the dense reference's on the round-tripped weights."""
    model = load_model(tiny_dir, dtype="float32", progress=False, quantization="mxfp8")[0]
    layer = model.model.layers[3]
    for module, attr in ((layer.self_attn.qkv_proj, "weight"), (layer.self_attn.o_proj, "weight"),
                         (layer.mlp.experts, "w13"), (layer.mlp.shared_experts.down_proj, "weight"),
                         (model.model.layers[0].mlp.gate_up_proj, "weight")):
        assert packed_format(module, attr) is MXFP8, module
    assert model.lm_head.weight.dtype == torch.float32 and layer.mlp.gate.weight.dtype == torch.float32

    llm = LLM(model=str(tiny_dir), dtype="float32", max_num_batched_tokens=32, max_num_seqs=4,
              quantization="mxfp8")
    served = serve(llm)
    source = canonical_weights(tiny_dir)
    weights = {n: (round_trip(w, MXFP8) if n.endswith(LINEAR_PARTS) else w) for n, w in source.items()}
    assert sum(n.endswith(LINEAR_PARTS) for n in weights) > 20
    assert_reference_greedy(weights, llm.engine.model_config, served)
