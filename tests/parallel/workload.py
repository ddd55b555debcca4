"""The workload every parallel layout must reproduce token for token: a batch that is chunked
(64-token budget) and preempted (a 14-block pool), seeded sampling beside greedy requests, and
a prefix-cache hit; plus the per-rank checks that the flags were honoured and that every rank
gave all its KV blocks and batch rows back."""
from refgreedy import assert_engine_no_near_ties

from m3serve.sampling_params import SamplingParams

PROMPT_LENS = (5, 37, 80, 150, 9, 120)
NUM_BLOCKS = 14

LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "tp4": dict(tensor_parallel_size=4),
    "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "ep4": dict(tensor_parallel_size=4, enable_expert_parallel=True),
    "dp2-ep2": dict(data_parallel_size=2, enable_expert_parallel=True),
}


def layout_sizes(flags: dict) -> tuple[int, int, int]:
    """(tp, dp, blocks per rank): each DP replica gets half the batch, so a smaller pool makes
    it preempt too."""
    tp, dp = flags.get("tensor_parallel_size", 1), flags.get("data_parallel_size", 1)
    return tp, dp, 12 if dp > 1 else NUM_BLOCKS


def prompts(lens=PROMPT_LENS, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2000, (n,), generator=g).tolist() for n in lens]


def engine_flags(tensor_parallel_size: int = 1, num_blocks: int = NUM_BLOCKS) -> dict:
    """Chunking and a pool of `num_blocks` blocks on every rank (fp32 tiny model: 5 layers of 2
    KV heads of 32 channels, split over TP up to 2 heads; 3 sparse layers of 32 index channels).
    Steps one after another, so the small pool preempts (async scheduling never preempts a
    request with a token in flight; it has its own test)."""
    kv_heads = 2 if tensor_parallel_size == 1 else 1
    bytes_per_token = 5 * 2 * kv_heads * 32 * 4 + 3 * 32 * 4
    return dict(dtype="float32", max_num_batched_tokens=64, max_num_seqs=8,
                kv_cache_memory=num_blocks * 16 * bytes_per_token, async_scheduling=False)


def waves() -> list[list[tuple[list[int], SamplingParams]]]:
    """Three waves of (prompt ids, params): the batch; a greedy request beside two seeded
    samplers; a request whose first 32 tokens wave 2 has cached."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    shared = prompts((40,), seed=5)[0]
    wave2 = [(shared, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
             (prompts((30,), seed=7)[0],
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)),
             (prompts((50,), seed=8)[0],
              SamplingParams(temperature=1.0, top_k=50, seed=8, max_tokens=10, ignore_eos=True))]
    return [[(p, greedy) for p in prompts()], wave2, [(shared + prompts((21,), seed=6)[0], greedy)]]


def assert_no_near_ties(llm, margin: float = 0.01) -> None:
    """The waves' greedy requests lead their runner-up by `margin` (in logits) at every step,
    so comparing their tokens across layouts, chunkings and batchings, which move the float32
    logits only in their last bits (~1e-6 here), can never flip on rounding."""
    greedy = [(p, q) for wave in waves() for p, q in wave if q.temperature == 0]
    params = [SamplingParams(temperature=0, max_tokens=q.max_tokens, ignore_eos=True, logprobs=2) for _, q in greedy]
    assert_engine_no_near_ties(llm.generate([{"prompt_token_ids": p} for p, _ in greedy], params, use_tqdm=False),
                               margin)


def run(llm) -> list[list[int]]:
    """The waves through the offline API -> token ids per request."""
    outs = []
    for wave in waves():
        outs += llm.generate([{"prompt_token_ids": p} for p, _ in wave], [q for _, q in wave],
                             use_tqdm=False)
    assert outs[-1].num_cached_tokens == 32
    run.texts = [o.outputs[0].text for o in outs]
    return [o.outputs[0].token_ids for o in outs]


def run_http(url: str, data_parallel: bool = False) -> list[str]:
    """The waves through a server's /v1/completions (each wave's requests at once) -> texts.
    With several DP replicas the last wave's prefix hit depends on which replica the
    concurrent wave 2 put its request on (requests go to the least loaded), so it is not
    checked there."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def complete(prompt, params):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "ignore_eos": True, "seed": params.seed}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    texts = []
    with ThreadPoolExecutor(8) as pool:
        for wave in waves():
            if all(params == wave[0][1] for _, params in wave):   # one request, all its prompts
                answer = complete([p for p, _ in wave], wave[0][1])
                texts += [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
            else:                                                  # one request each, at once
                texts += [a["choices"][0]["text"] for a in pool.map(lambda pq: complete(*pq), wave)]
            if len(wave) == 1 and not data_parallel:
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    return texts


def check_ranks(states, tp: int, dp: int, ep: bool, num_experts: int = 8, inter: int = 32) -> None:
    """The engine really runs tp x dp rank processes laid out as asked, and is idle and clean."""
    ranks = [r for s in states for r in s.ranks]
    assert len(states) == dp and len(ranks) == tp * dp
    assert len({r["pid"] for r in ranks}) == tp * dp
    assert sorted(r["rank"] for r in ranks) == list(range(tp * dp))
    for r in ranks:
        assert r["world_size"] == tp * dp and r["tp_size"] == tp and r["dp_size"] == dp
        assert r["tp_rank"] == r["rank"] % tp and r["dp_rank"] == r["rank"] // tp
        assert r["vocab_rows"] == -(-2048 // tp)
        if ep:
            assert r["num_local_experts"] == num_experts // (tp * dp) and r["expert_inter_local"] == inter
        else:
            assert r["num_local_experts"] == num_experts and r["expert_inter_local"] == inter // (tp * dp)
    if ep:
        assert sorted(r["first_expert"] for r in ranks) == [i * num_experts // (tp * dp) for i in range(tp * dp)]
    for s in states:
        assert s.integrity_error is None
        assert s.num_running == s.num_waiting == 0
        assert s.num_free_blocks == s.num_usable_blocks
        assert all(r["num_batch_rows"] == 0 for r in s.ranks)
