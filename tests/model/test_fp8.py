"""FP8 options on the CPU reference path: online FP8 weights (`quantization="fp8"`) and FP8 KV /
index caches. Quantised outputs must stay close to bf16 (short prompts, where no block selection
can flip), the right tensors must be quantised and the caches must shrink."""
import pytest
import torch
import torch.nn.functional as F

from m3serve.layers.quant import fp8_linear, quantize_weight
from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams


def test_fp8_linear_matches_dequantised_product():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    wq, ws = quantize_weight(w)
    assert wq.dtype == torch.float8_e4m3fn and ws.shape == (48,)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 of each value (plus subnormal spacing)
    assert ((wq.float() * ws[:, None] - w).abs() <= w.abs() * 2**-4 + ws[:, None] * 2**-9).all()
    y = fp8_linear(x, wq, ws)
    exact = x.float() @ w.t()
    assert F.cosine_similarity(y.float().flatten(), exact.flatten(), dim=0) > 0.995


@pytest.fixture(scope="module")
def prompt():
    return {"prompt_token_ids": torch.randint(0, 2000, (60,), generator=torch.Generator().manual_seed(3)).tolist()}


def last_logprobs(llm, prompt):
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    return out


@pytest.mark.parametrize("flags", [dict(quantization="fp8"), dict(kv_cache_dtype="fp8", index_cache_dtype="fp8")],
                         ids=["weights", "caches"])
def test_fp8_close_to_bf16(tiny_dir, prompt, flags):
    base = LLM(model=str(tiny_dir), dtype="bfloat16", kv_cache_memory=1 << 24)
    q = LLM(model=str(tiny_dir), dtype="bfloat16", kv_cache_memory=1 << 24, **flags)
    model = q.engine.worker.model
    if "quantization" in flags:
        layer = model.model.layers[2]
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        assert layer.mlp.experts.w13.dtype == torch.float8_e4m3fn and layer.mlp.experts.w13_scale.shape == (8, 64)
        assert layer.mlp.gate.weight.dtype == torch.float32                    # router excluded
        assert model.lm_head.weight.dtype == torch.bfloat16                    # lm_head excluded
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    else:
        assert q.engine.worker.runner.kv_caches[0].dtype == torch.float8_e4m3fn
        assert q.engine.worker.runner.index_caches[1].dtype == torch.float8_e4m3fn
        assert q.engine.worker.num_blocks > 1.9 * base.engine.worker.num_blocks   # half the bytes
    a, b = last_logprobs(base, prompt), last_logprobs(q, prompt)
    ids = prompt["prompt_token_ids"]
    # the model's probability of each actual next prompt token, bf16 vs fp8
    pa = torch.tensor([a.prompt_logprobs[p][ids[p]].logprob for p in range(1, 60)])
    pb = torch.tensor([b.prompt_logprobs[p][ids[p]].logprob for p in range(1, 60)])
    assert (pa - pb).abs().median() < 0.25
    assert F.cosine_similarity(pa, pb, dim=0) > 0.98


def test_chunked_weight_quantisation_equals_whole(monkeypatch):
    """quantize_weight works in row chunks (bounded fp32 temporaries): same bits as one pass."""
    import m3serve.layers.quant as quant
    from m3serve.kernels.ref.fused_moe import quant_weight_fp8
    w = (torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    monkeypatch.setattr(quant, "_QUANT_CHUNK_ELEMS", 7 * 24)     # 7 rows per chunk, ragged tail
    q, s = quant.quantize_weight(w)
    q_ref, s_ref = quant_weight_fp8(w)
    assert q.shape == w.shape and s.shape == (3, 40)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_online_fp8_quantises_each_weight_as_it_loads(tiny_dir, monkeypatch):
    """Online FP8 quantises every weight as soon as its last shard arrives: the same bits as
    quantising a whole bf16 model after loading, with only a few bf16 weights alive at a time
    (the bf16 model of a large checkpoint need not fit the device)."""
    import weakref

    import m3serve.model.loader as loader
    from m3serve.layers.quant import FP8
    from m3serve.model.quantize import quantize_param_fp8

    ref, _, _ = loader.load_model(tiny_dir, dtype="bfloat16", progress=False)
    made, peak = [], [0]        # every bf16 weight the loader made; how many were alive at once
    real_materialize = loader._materialize

    def materialize(model, name, param, device):
        real = real_materialize(model, name, param, device)
        made.append(weakref.ref(real))
        peak[0] = max(peak[0], sum(r() is not None for r in made))
        return real

    monkeypatch.setattr(loader, "_materialize", materialize)
    q, _, _ = loader.load_model(tiny_dir, dtype="bfloat16", progress=False, quantization="fp8")
    assert len(made) > 10 and 1 <= peak[0] <= 3, (len(made), peak)
    assert not any(p.is_meta for p in q.parameters())
    quantised = 0
    for name, p in ref.named_parameters():
        owner, _, attr = name.rpartition(".")
        qmod = q.get_submodule(owner)
        if quantize_param_fp8(ref, name):          # the old way: quantise after a bf16 load
            quantised += 1
            rw, qw = getattr(ref.get_submodule(owner), attr), getattr(qmod, attr)
            scale = "weight_scale" if attr == "weight" else attr + "_scale"
            assert qw.dtype == FP8 and torch.equal(qw.view(torch.uint8), rw.view(torch.uint8)), name
            assert torch.equal(getattr(qmod, scale), getattr(ref.get_submodule(owner), scale)), name
        else:
            assert torch.equal(getattr(qmod, attr), p), name
    assert quantised > 10
