"""Time a long prefill of the embedded tiny model through LLM (max_tokens=1): `python scripts/cpu_prefill_bench.py [num_tokens] [prof]`."""
import sys, time, os, random
import torch
from m3serve import LLM, SamplingParams
n = int(sys.argv[1]) if len(sys.argv) > 1 else 30000
prof = len(sys.argv) > 2 and sys.argv[2] == "prof"
print("threads", torch.get_num_threads(), flush=True)
t0 = time.perf_counter()
llm = LLM(max_model_len=131072)
print("build", time.perf_counter() - t0, flush=True)
random.seed(0)
ids = [random.randrange(3, 2000) for _ in range(n)]
p = SamplingParams(max_tokens=1, temperature=0)
llm.generate([{"prompt_token_ids": ids[:64]}], p)
t0 = time.perf_counter(); c0 = time.process_time()
if prof:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
out = llm.generate([{"prompt_token_ids": ids}], p)
dt = time.perf_counter() - t0; cpu = time.process_time() - c0
if prof:
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
print(f"prefill {n} tokens: {dt:.2f} s (process CPU {cpu:.1f} s)  token {out[0].outputs[0].token_ids}", flush=True)
