"""Time one long prefill of the embedded tiny model (or --model DIR, e.g. `make-tiny`'s random
one) on the CPU, through `LLM` (max_tokens 1): what an agent client's first prompt costs the CI
machine (docs/performance.md, "CPU prefill of the tiny model").

    taskset -c 0,1 python scripts/cpu_prefill_bench.py [NUM_TOKENS] [--model DIR] [--profile]
"""
import argparse
import random
import time

import torch

from m3serve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("num_tokens", type=int, nargs="?", default=30000)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top 25 functions")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}", flush=True)
    start = time.perf_counter()
    llm = LLM(model=args.model, max_model_len=max(131072, args.num_tokens + 1))
    print(f"engine built in {time.perf_counter() - start:.1f} s", flush=True)
    rng = random.Random(0)
    ids = [rng.randrange(3, 2000) for _ in range(args.num_tokens)]
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([{"prompt_token_ids": ids[:64]}], params, use_tqdm=False)      # warm-up
    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    wall, cpu = time.perf_counter(), time.process_time()
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if profiler is not None:
        import pstats
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    print(f"prefill of {args.num_tokens} tokens: {wall:.2f} s (process CPU {cpu:.1f} s), "
          f"first token {out[0].outputs[0].token_ids}")


if __name__ == "__main__":
    main()
