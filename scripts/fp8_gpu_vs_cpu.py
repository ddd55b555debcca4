"""Where online FP8 on the GPU leaves the CPU reference: the tiny model (random weights, float32
activations, `quantization="fp8"`), greedy, six prompts; per prompt the first token that differs
and both runs' top-two logprob gap there (a near tie is small). Runs: the GPU's default ops, the
GPU with the reference ops (eager), and the CPU.

    PYTHONPATH=. python scripts/fp8_gpu_vs_cpu.py
"""
import tempfile
from pathlib import Path

import torch

from m3serve.layers import dispatch
from m3serve.llm import LLM
from m3serve.model.tiny import make_tiny
from m3serve.sampling_params import SamplingParams


def run(model: Path, device: str, eager: bool) -> list[tuple[list[int], list[float]]]:
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 2000, (n,), generator=g).tolist()}
               for n in (5, 37, 80, 150, 9, 120)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm = LLM(model=str(model), dtype="float32", device=device, enforce_eager=eager, quantization="fp8",
              **({} if device == "cpu" else dict(max_num_batched_tokens=48, kv_cache_memory=1 << 28)))
    out = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        top = [sorted((e.logprob for e in entry.values()), reverse=True) for entry in o.outputs[0].logprobs]
        out.append((list(o.outputs[0].token_ids), [t[0] - t[1] for t in top]))
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def first_differences(a, b) -> list:
    """Per prompt None (equal) or (index, a's gap there, b's gap there)."""
    found = []
    for (ta, ga), (tb, gb) in zip(a, b):
        i = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        found.append(None if i is None else (i, round(ga[i], 4), round(gb[i], 4)))
    return found


def main() -> None:
    model = make_tiny(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    cpu = run(model, "cpu", True)
    gpu = run(model, "cuda", False)
    print("GPU default ops against the CPU:", first_differences(gpu, cpu), dispatch.summary(), flush=True)
    dispatch.executed.clear()
    with dispatch.reference_ops():
        ref = run(model, "cuda", True)
    print("GPU reference ops against the CPU:", first_differences(ref, cpu), dispatch.summary(), flush=True)
    print("GPU default against GPU reference ops:", first_differences(gpu, ref), flush=True)


if __name__ == "__main__":
    main()
