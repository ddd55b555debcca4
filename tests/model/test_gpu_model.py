"""GPU fast path against the reference ops (run on a GPU: `pytest -m gpu tests/model/test_gpu_model.py`
in its own process, so that TRITON_F32_DEFAULT below applies to every kernel compiled)."""
import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

# fp32 tl.dot defaults to TF32 on Hopper; the tiny-model comparison wants IEEE fp32 products.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

pytestmark = pytest.mark.gpu


def test_tiny_greedy_gpu_equals_cpu_reference(tiny_dir):
    from m3serve.layers import dispatch
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    from test_engine import prompts

    ps = [{"prompt_token_ids": p} for p in prompts((5, 37, 80, 150, 9, 120))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(model=str(tiny_dir), dtype="float32", device="cpu", enforce_eager=True)
    gpu = LLM(model=str(tiny_dir), dtype="float32", device="cuda", max_num_batched_tokens=48,
              kv_cache_memory=1 << 28)
    want = [o.outputs[0].token_ids for o in cpu.generate(ps, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in gpu.generate(ps, params, use_tqdm=False)]
    assert got == want
    assert "triton" in dispatch.summary()["attention"]
    del cpu, gpu
    torch.cuda.empty_cache()


def test_realshape_l4_triton_matches_reference_ops(tmp_path):
    from m3serve.bench.realshape import write_realshape_dir
    from m3serve.layers.dispatch import reference_ops
    from m3serve.model.loader import load_model
    from paged import PagedRunner

    d = write_realshape_dir(tmp_path / "rs", num_layers=4)
    model, cfg, _ = load_model(d, dtype="bfloat16", device="cuda", load_format="dummy", seed=0)
    gen = torch.Generator().manual_seed(0)
    seqs = {0: torch.randint(0, 2000, (3000,), generator=gen).tolist(),
            1: torch.randint(0, 2000, (700,), generator=gen).tolist()}
    hidden = {}
    for name in ("triton", "reference"):
        runner = PagedRunner(model, num_blocks=64, device="cuda")
        captured = []
        with reference_ops() if name == "reference" else contextlib.nullcontext():
            runner.step(seqs)
            captured.append(runner.hidden)
            runner.step({0: [5], 1: [7]})
            captured.append(runner.hidden)
        hidden[name] = torch.cat([c.float() for c in captured])
    a, b = hidden["triton"], hidden["reference"]
    cos_all = F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    cos_tok = F.cosine_similarity(a, b, dim=-1)
    print(f"real-shape L=4: cosine(all)={cos_all:.6f} per-token min={cos_tok.min():.5f} "
          f"p1={cos_tok.quantile(0.01):.5f}")
    assert cos_all >= 0.999
