"""Where online FP8 on the GPU leaves the CPU reference: the tiny model (random weights, float32
activations, `quantization="fp8"`), six prompts.

1. Greedy, 16 tokens: per prompt the first token that differs from the CPU's and both runs'
   top-two logprob gap there (a near tie is small), for the GPU's default ops (CUDA graphs).
2. The first token's top-8 logprobs after each prompt (prefill only, eager), against the CPU's:
   the largest logprob difference over the ids both lists hold, and whether the top id agrees,
   for the GPU with every op's default path and with one part at a time swapped for its
   reference -- the op-level references (`dispatch.reference_ops(op)`), the Triton per-token
   FP8 quantisation (`quant_rows_fp8`) and cuBLAS's FP8 product (`torch._scaled_mm`, replaced by
   the same operands' product in fp64, as the CPU computes it). The part whose swap brings the
   GPU to the CPU is where the difference comes from.

    PYTHONPATH=. python scripts/fp8_gpu_vs_cpu.py
"""
import contextlib
import os
import tempfile
from pathlib import Path
from unittest import mock

# IEEE fp32 products in the Triton kernels, as the GPU tests run them (Hopper's default is TF32)
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import torch  # noqa: E402

from m3serve.kernels import fused_moe  # noqa: E402
from m3serve.kernels.ref.fused_moe import quant_rows_fp8_ref  # noqa: E402
from m3serve.layers import dispatch  # noqa: E402
from m3serve.llm import LLM  # noqa: E402
from m3serve.model.tiny import make_tiny  # noqa: E402
from m3serve.sampling_params import SamplingParams  # noqa: E402

TOP = 8


def prompts() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(0, 2000, (n,), generator=g).tolist()}
            for n in (5, 37, 80, 150, 9, 120)]


def make_llm(model: Path, device: str, eager: bool) -> LLM:
    return LLM(model=str(model), dtype="float32", device=device, enforce_eager=eager, quantization="fp8",
               **({} if device == "cpu" else dict(max_num_batched_tokens=48, kv_cache_memory=1 << 28)))


def greedy(model: Path, device: str, eager: bool) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm = make_llm(model, device, eager)
    out = []
    for o in llm.generate(prompts(), params, use_tqdm=False):
        top = [sorted((e.logprob for e in entry.values()), reverse=True) for entry in o.outputs[0].logprobs]
        out.append((list(o.outputs[0].token_ids), [t[0] - t[1] for t in top]))
    release(llm)
    return out


def first_logprobs(model: Path, device: str) -> list[dict[int, float]]:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=TOP)
    llm = make_llm(model, device, True)
    out = [{t: e.logprob for t, e in o.outputs[0].logprobs[0].items()}
           for o in llm.generate(prompts(), params, use_tqdm=False)]
    release(llm)
    return out


def release(llm: LLM) -> None:
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_differences(a, b) -> list:
    """Per prompt None (equal) or (index, a's gap there, b's gap there)."""
    found = []
    for (ta, ga), (tb, gb) in zip(a, b):
        i = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        found.append(None if i is None else (i, round(ga[i], 4), round(gb[i], 4)))
    return found


def compare(got: list[dict[int, float]], want: list[dict[int, float]]) -> str:
    worst, top_agree = 0.0, 0
    for g, w in zip(got, want):
        shared = g.keys() & w.keys()
        worst = max([worst] + [abs(g[t] - w[t]) for t in shared])
        top_agree += max(g, key=g.get) == max(w, key=w.get)
    return f"max |d logprob| {worst:.2e}, top id agrees in {top_agree}/{len(got)}"


def fp64_scaled_mm(a, b, scale_a=None, scale_b=None, out_dtype=None, **_):
    """torch._scaled_mm's row-wise contract computed as the CPU reference does: both operands
    dequantised, multiplied in fp64, rounded once."""
    y = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
    return y.to(out_dtype)


def main() -> None:
    model = make_tiny(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    cpu_greedy = greedy(model, "cpu", True)
    gpu_greedy = greedy(model, "cuda", False)
    print("greedy, GPU default ops (graphs) against the CPU:", first_differences(gpu_greedy, cpu_greedy),
          dispatch.summary(), flush=True)
    cpu = first_logprobs(model, "cpu")
    variants = {
        "GPU default ops": contextlib.nullcontext,
        "GPU, every op's reference": lambda: dispatch.reference_ops(),
        "GPU, moe reference": lambda: dispatch.reference_ops("moe"),
        "GPU, rms_norm reference (no norm-made FP8)": lambda: dispatch.reference_ops("rms_norm"),
        "GPU, attention reference": lambda: dispatch.reference_ops("attention"),
        "GPU, quant_rows_fp8 reference": lambda: mock.patch.object(fused_moe, "quant_rows_fp8",
                                                                    quant_rows_fp8_ref),
        "GPU, _scaled_mm in fp64": lambda: mock.patch.object(torch, "_scaled_mm", fp64_scaled_mm),
        "GPU, every op's reference and _scaled_mm in fp64": _both,
    }
    for name, ctx in variants.items():
        dispatch.executed.clear()
        with ctx():
            got = first_logprobs(model, "cuda")
        print(f"first token, {name}: {compare(got, cpu)}; paths {dispatch.summary()}", flush=True)


@contextlib.contextmanager
def _both():
    with dispatch.reference_ops(), mock.patch.object(torch, "_scaled_mm", fp64_scaled_mm):
        yield


if __name__ == "__main__":
    main()
