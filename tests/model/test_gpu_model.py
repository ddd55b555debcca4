"""GPU fast path against the reference ops (run on a GPU: `pytest -m gpu tests/model/test_gpu_model.py`
in its own process, so that TRITON_F32_DEFAULT below applies to every kernel compiled)."""
import gc
import os

import pytest
import torch
import torch.nn.functional as F

# fp32 tl.dot defaults to TF32 on Hopper; the tiny-model comparison wants IEEE fp32 products.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

pytestmark = pytest.mark.gpu

# The drafting tests speculate at every batch size (their drafts are what they check): without
# disable_by_batch_size a GPU engine turns drafts off where they measure slower (core/spec_gate.py)
ALWAYS = 1000


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


def test_tiny_m31_flash_greedy_gpu_equals_dense_reference(tiny_m31_dir):
    """MiniMax-M3.1-Flash's all-MSA flavor on the GPU path (Triton indexer and sparse attention
    in every layer, the forced initial block, CUDA graphs, chunked prefill, a prefix hit): the
    greedy tokens equal the dense CPU reference's."""
    from m3serve.layers import dispatch
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    from refgreedy import reference_greedy, reference_model
    from test_engine import prompts

    ps = prompts((5, 37, 80, 150, 9, 120), seed=2)
    again = ps[3][:96] + prompts((11,), seed=3)[0]          # 6 full blocks of 16 cached
    ref = reference_model(tiny_m31_dir)
    want = [reference_greedy(ref, p, 8) for p in (*ps, again)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gpu = LLM(model=str(tiny_m31_dir), dtype="float32", device="cuda", max_num_batched_tokens=48,
              kv_cache_memory=1 << 28)
    got = [o.outputs[0].token_ids for o in gpu.generate([{"prompt_token_ids": p} for p in ps], params,
                                                         use_tqdm=False)]
    hit = gpu.generate([{"prompt_token_ids": again}], params, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 96
    assert got + [hit.outputs[0].token_ids] == want
    assert "triton" in dispatch.summary()["attention"]
    del gpu
    torch.cuda.empty_cache()


def test_tiny_async_scheduling_gpu_equals_cpu(tiny_dir):
    """--async-scheduling with CUDA graphs: the in-flight tokens fed on the device, copied to
    the host while the next step runs; the async test workload's tokens equal the CPU's, one
    step after another (stops on tokens, max_tokens 1, chunks, sampling and logprobs beside)."""
    from m3serve.llm import LLM
    from test_async_scheduling import generate, workload

    prompts, params = workload()
    cpu = LLM(model=str(tiny_dir), dtype="float32", device="cpu", enforce_eager=True, max_num_seqs=6)
    gpu = LLM(model=str(tiny_dir), dtype="float32", device="cuda", max_num_batched_tokens=48, max_num_seqs=6,
              kv_cache_memory=1 << 28, async_scheduling=True)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]      # sampled ones differ by device RNG
    want, got = generate(cpu, prompts, params), generate(gpu, prompts, params)
    assert [got[i] for i in greedy] == [want[i] for i in greedy]
    assert gpu.engine.core.scheduler.num_deferred_steps > 10 and gpu.engine.worker.runner.num_graph_steps > 10
    del cpu, gpu
    torch.cuda.empty_cache()


def test_decode_graph_replays_report_to_the_probe(tiny_dir):
    """Real CUDA graphs: after each decode replay the installed probe (layers/probes.py)
    receives the routed experts and selected blocks of the step's real requests; they equal the
    eager GPU engine's step by step (the bench's measured-experts count reads them)."""
    from m3serve.layers import probes
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    from test_engine import prompts

    class Cloning:
        def __init__(self):
            self.reports = []

        def record(self, name, layer_id, tensor):
            self.reports.append((name, layer_id, tensor.clone()))   # replays rewrite the buffers

    ps = [{"prompt_token_ids": p} for p in prompts((5, 37, 80))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seen = []
    for eager in (True, False):
        llm = LLM(model=str(tiny_dir), dtype="float32", device="cuda", enforce_eager=eager,
                  max_num_seqs=4, kv_cache_memory=1 << 28)
        with probes.installed(Cloning()) as probe:
            llm.generate(ps, params, use_tqdm=False)
        seen.append((probe.reports, llm.engine.worker.runner.num_graph_steps))
        del llm
    (want, eager_graphs), (got, graph_steps) = seen
    assert eager_graphs == 0 and graph_steps >= 4
    assert [r[:2] for r in got] == [r[:2] for r in want]
    for (name, layer, a), (_, _, b) in zip(want, got):
        assert a.shape == b.shape and torch.equal(a.long(), b.long()), (name, layer)


def test_tiny_greedy_mp_executor_on_one_gpu(tiny_dir):
    """The multiprocess executor at world size 1: an engine process joining a one-rank NCCL
    world, CUDA graphs captured there; greedy tokens equal the CPU reference's."""
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    from test_engine import prompts

    ps = [{"prompt_token_ids": p} for p in prompts((5, 37, 80, 150, 9, 120))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(model=str(tiny_dir), dtype="float32", device="cpu", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in cpu.generate(ps, params, use_tqdm=False)]
    mp = LLM(model=str(tiny_dir), dtype="float32", device="cuda", max_num_batched_tokens=48,
             kv_cache_memory=1 << 28, distributed_executor_backend="mp", cudagraph_capture_sizes="1,2,4,8")
    try:
        assert [o.outputs[0].token_ids for o in mp.generate(ps, params, use_tqdm=False)] == want
        (state,) = mp.engine.engine_states()
        assert state.ranks[0]["device"] == "cuda:0" and state.num_free_blocks == state.num_usable_blocks
    finally:
        mp.shutdown()


def test_tiny_speculative_graphs_gpu(tiny_dir, tmp_path):
    """EAGLE3 speculation on the GPU with its verify + draft CUDA graphs: greedy tokens equal
    the CPU reference without speculation (a random draft: nearly every draft rejected)."""
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    from m3serve.distill.tiny_drafts import make_draft
    from test_engine import prompts

    draft = make_draft(tmp_path / "eagle3", "eagle3", tiny_dir)
    ps = [{"prompt_token_ids": p} for p in prompts((5, 37, 80, 150, 9, 120))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(model=str(tiny_dir), dtype="float32", device="cpu", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in cpu.generate(ps, params, use_tqdm=False)]
    gpu = LLM(model=str(tiny_dir), dtype="float32", device="cuda", kv_cache_memory=1 << 28,
              cudagraph_capture_sizes="1,2,4,8",
              speculative_config={"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3,
                                  "disable_by_batch_size": ALWAYS})
    assert [o.outputs[0].token_ids for o in gpu.generate(ps, params, use_tqdm=False)] == want
    runner = gpu.engine.worker.runner
    assert runner.spec_graphs is not None and runner.num_graph_steps > 10
    assert gpu.engine.core.scheduler.spec_stats.num_drafts > 10


def test_tiny_dspark_gpu(tiny_dir, tmp_path):
    """DSpark on the GPU (window attention through the window's blocks and the per-token left
    edge, MXFP8 projections through the packed kernels, verify + draft CUDA graphs, the draft's
    own window pool and tables): greedy tokens equal the CPU reference without speculation, the
    window pool is whole afterwards, and the eager GPU engine proposes the CPU engine's drafts
    (fp32 both), also after a prefix hit that finds the draft's window blocks."""
    import shutil

    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    from m3serve.distill.tiny_drafts import make_draft
    from test_engine import prompts

    target = tmp_path / "target"
    shutil.copytree(tiny_dir, target)
    make_draft(target, "dspark", tiny_dir)
    spec = {"method": "dspark", "num_speculative_tokens": 5, "disable_by_batch_size": ALWAYS}
    ps = [{"prompt_token_ids": p} for p in prompts((5, 37, 80, 150, 9, 120))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(model=str(tiny_dir), dtype="float32", device="cpu", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in cpu.generate(ps, params, use_tqdm=False)]
    gpu = LLM(model=str(target), dtype="float32", device="cuda", kv_cache_memory=1 << 28,
              cudagraph_capture_sizes="1,2,4,8", speculative_config=spec)
    assert [o.outputs[0].token_ids for o in gpu.generate(ps, params, use_tqdm=False)] == want
    runner = gpu.engine.worker.runner
    assert runner.spec_graphs is not None and runner.num_graph_steps > 10
    draft = gpu.engine.core.kv_manager.draft
    assert draft.num_free_blocks == draft.pool.num_usable_blocks
    del gpu

    def first_drafts(device):
        llm = LLM(model=str(target), dtype="float32", device=device, enforce_eager=True,
                  kv_cache_memory=1 << 26, speculative_config=spec)
        proposer, seen = llm.engine.worker.runner.proposer, []
        real = proposer.propose
        proposer.propose = lambda step: seen.append(real(step).tolist()) or torch.tensor(seen[-1])
        few = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        llm.generate([ps[3]], few, use_tqdm=False)
        llm.generate([{"prompt_token_ids": ps[3]["prompt_token_ids"] + [5, 6, 7]}], few, use_tqdm=False)
        assert llm.engine.core.kv_manager.draft.num_hit_blocks > 0
        return seen
    assert first_drafts("cuda") == first_drafts("cpu")


@pytest.mark.parametrize("rule", ["measured", "fixed"])
def test_tiny_measured_gate_gpu(tiny_dir, tmp_path, rule):
    """The GPU default for which batches speculate (timed steps with and without drafts, plain
    decode graphs at every size), and the fixed rule (disable_by_batch_size 3): greedy tokens
    equal the CPU reference, whichever kind each step ran, over a batch that shrinks through
    every bucket; plain steps are deferred (async scheduling) and, under the fixed rule, drafts
    follow them after a step that lands their tokens."""
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    from m3serve.distill.tiny_drafts import make_draft
    from test_engine import prompts

    draft = make_draft(tmp_path / "eagle3", "eagle3", tiny_dir)
    ps = [{"prompt_token_ids": p} for p in prompts((5, 37, 80, 150, 9, 120))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 40, 60, 80, 100, 120)]
    cpu = LLM(model=str(tiny_dir), dtype="float32", device="cpu", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in cpu.generate(ps, params, use_tqdm=False)]
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    if rule == "fixed":
        spec["disable_by_batch_size"] = 3
    gpu = LLM(model=str(tiny_dir), dtype="float32", device="cuda", kv_cache_memory=1 << 28,
              cudagraph_capture_sizes="1,2,4,8", speculative_config=spec)
    assert [o.outputs[0].token_ids for o in gpu.generate(ps, params, use_tqdm=False)] == want
    sched = gpu.engine.core.scheduler
    assert sched.spec_gate.rule == rule and sched.spec_stats.num_drafts > 0
    assert sched.num_deferred_steps > 0
    if rule == "fixed":
        assert sched.num_landing_steps > 0
    assert gpu.engine.worker.runner.graphs is not None      # the plain decode graphs
    from m3serve.worker.spec_graphs import spec_graph_plan, spec_graph_widths
    assert set(gpu.engine.worker.runner.spec_graphs.verify_graphs) == set(
        spec_graph_plan([1, 2, 4, 8], spec_graph_widths(3, rule)))


def test_tiny_draft_widths_and_switch_graphs_gpu(tiny_dir, tmp_path):
    """The measured gate under a fake clock where verifying one draft costs little and more
    cost much (EAGLE3 k 4 with drafts that are the true continuation): steps verify 4, 3 and 1
    drafts while exploring, then 1, each replaying the verify + draft graphs of its query width,
    and the first step with drafts after plain ones replays the switch graph (width 1); greedy
    tokens equal the CPU reference."""
    import sys
    from collections import Counter
    from pathlib import Path

    from m3serve.core.spec_gate import SpeculationGate
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    from m3serve.distill.tiny_drafts import make_draft
    from test_engine import prompts
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "spec"))
    from test_spec_engine import _oracle
    from test_spec_graphs_host import oracle_drafts

    k = 4
    draft = make_draft(tmp_path / "eagle3", "eagle3", tiny_dir)
    ps = prompts((9, 21, 33, 45))
    # (64 tokens: long enough that exploring every width and plain steps ends before they do)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    cpu = LLM(model=str(tiny_dir), dtype="float32", device="cpu", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in cpu.generate([{"prompt_token_ids": p} for p in ps], params,
                                                         use_tqdm=False)]
    gpu = LLM(model=str(tiny_dir), dtype="float32", device="cuda", kv_cache_memory=1 << 28,
              cudagraph_capture_sizes="1,2,4,8",
              speculative_config={"method": "eagle3", "model": str(draft), "num_speculative_tokens": k})
    truth = {tuple(p): p + w for p, w in zip(ps, want)}
    _oracle(gpu, truth, k)
    oracle_drafts(gpu, truth, k)
    core, now = gpu.engine.core, [0.0]
    execute = core.executor.execute_model
    core.scheduler.spec_gate = SpeculationGate(k, measured=True, clock=lambda: now[0])

    def timed(step):
        width = max((len(d) for d in step.scheduled_spec_decode_tokens.values()), default=0)
        now[0] += 1.0 + (0.1 if width <= 1 else 5.0)
        return execute(step)
    core.executor.execute_model = timed
    g = gpu.engine.worker.runner.spec_graphs
    replays, verify = Counter(), g.verify_graphs

    class Counting(dict):           # every replay reads its pair here
        def __getitem__(self, key):
            replays[key[1]] += 1
            return super().__getitem__(key)
    g.verify_graphs = Counting(verify)
    assert [o.outputs[0].token_ids for o in gpu.generate([{"prompt_token_ids": p} for p in ps], params,
                                                         use_tqdm=False)] == want
    assert all(replays[w + 1] > 0 for w in (4, 3, 1)) and replays[1] > 0
    assert core.scheduler.spec_gate.buckets[4].choice == 1


def test_tiny_speculative_graphs_structured_gpu(tiny_dir, tmp_path):
    """Structured outputs with EAGLE3 speculation on the GPU: the verify CUDA graph's logits
    get the grammar masks (filled on the host before the replay, applied on the device); greedy
    tokens equal the GPU without speculation, and every output holds its grammar."""
    import json
    import re

    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams, StructuredOutputsParams
    from m3serve.distill.tiny_drafts import make_draft
    from test_engine import prompts

    pytest.importorskip("xgrammar")
    draft = make_draft(tmp_path / "eagle3", "eagle3", tiny_dir)
    color = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "n": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["color", "n"], "additionalProperties": False}
    regex = r"[a-z]{2,6}( [a-z]{1,5}){2,5}\."
    ps = [{"prompt_token_ids": p} for p in prompts((5, 37, 80, 9))]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=color, disable_any_whitespace=True) if i % 2 == 0 else StructuredOutputsParams(regex=regex))
        for i in range(len(ps))]
    flags = dict(model=str(tiny_dir), dtype="float32", device="cuda", kv_cache_memory=1 << 28,
                 cudagraph_capture_sizes="1,2,4,8")
    want = [o.outputs[0].token_ids for o in LLM(**flags).generate(ps, params, use_tqdm=False)]
    gpu = LLM(**flags, speculative_config={"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3,
                                  "disable_by_batch_size": ALWAYS})
    outs = gpu.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    for i, o in enumerate(outs):
        text = o.outputs[0].text
        assert json.loads(text)["color"] in ("red", "green", "blue") if i % 2 == 0 else re.fullmatch(regex, text)
    runner = gpu.engine.worker.runner
    assert runner.spec_graphs is not None and runner.num_graph_steps > 5


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
    # Random real-shape weights make expert and block choices near-tied; bf16 rounding differences
    # between the kernels and the reference flip some of them, and a flip changes a token's
    # output outright. The reference is therefore made to take the Triton path's choices
    # (recorded), so the comparison measures the arithmetic; the unforced figure is printed too.
    import m3serve.layers.attention as attention_mod
    import m3serve.layers.moe as moe_mod

    from m3serve.layers import probes

    def run(forced=None):
        runner = PagedRunner(model, num_blocks=64, device="cuda")
        captured = []
        with probes.installed(probes.Recorder()) as rec:
            for chunk in (seqs, {0: [5], 1: [7]}):
                runner.step(chunk)
                captured.append(runner.hidden.float())
        return torch.cat(captured), rec.tensors(probes.SPARSE_BLOCKS), rec.tensors(probes.ROUTED_EXPERTS)

    triton_h, selections, expert_ids = run()
    with reference_ops():
        free_h, _, _ = run()
        sel_iter, exp_iter = iter(selections), iter(expert_ids)
        real_route = moe_mod.route

        def forced_route(x, gate_w, bias, top_k, scale):
            ids = next(exp_iter).long()
            s = torch.sigmoid(moe_mod.linear(x.float(), gate_w.float())).gather(1, ids)
            return s / s.sum(-1, keepdim=True) * scale, ids

        orig_topk = attention_mod.index_topk_ref
        attention_mod.index_topk_ref = lambda *a, **k: next(sel_iter).long()
        moe_mod.route = forced_route
        try:
            forced_h, _, _ = run()
        finally:
            attention_mod.index_topk_ref, moe_mod.route = orig_topk, real_route
    for name, ref in (("unforced", free_h), ("forced", forced_h)):
        cos_all = F.cosine_similarity(triton_h.flatten(), ref.flatten(), dim=0).item()
        cos_tok = F.cosine_similarity(triton_h, ref, dim=-1)
        print(f"real-shape L=4 {name}: cosine(all)={cos_all:.6f} per-token min={cos_tok.min():.5f} "
              f"p1={cos_tok.quantile(0.01):.5f}")
    cos_forced = F.cosine_similarity(triton_h.flatten(), forced_h.flatten(), dim=0).item()
    assert cos_forced >= 0.999


def test_no_triton_compile_while_serving_after_warm_up(tiny_dir):
    """After start-up (decode graphs + the prefill and sampler warm-up), prompts of many lengths,
    alone and beside decodes, greedy and sampled, compile no new Triton variant (a compile
    stalls every request)."""
    from m3serve.bench.jit_stats import new_variants, variants_by_kernel
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    llm = LLM(model=str(tiny_dir), dtype="bfloat16", device="cuda", max_num_batched_tokens=2048,
              max_num_seqs=16, max_model_len=4096)
    before = variants_by_kernel()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, max_tokens=8, ignore_eos=True)
    for lens in ([37], [150, 3], [700, 5, 9, 1000], [1900], [64] * 12, [2500, 20]):
        prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 5 for j in range(n)]}
                   for i, n in enumerate(lens)]
        llm.generate(prompts, greedy, use_tqdm=False)
    llm.generate(prompts, sampled, use_tqdm=False)        # the top-k / top-p cut-off kernels
    assert new_variants(before) == {}


@pytest.mark.parametrize("fmt,flavor", [(f, "m3") for f in ("mxfp8", "nvfp4-modelopt", "nvfp4-ct",
                                                             "mxfp4-quark")] + [("mxfp8-nvfp4", "m3.1-flash")])
def test_quantised_tiny_greedy_gpu_equals_reference(quant_dir, fmt, flavor):
    """Each quantised checkpoint layout on the GPU path (packed weights read by the packed
    kernels, CUDA graphs on, chunked prefill, a prefix hit): every greedy token is the dense
    reference's on the dequantised weights."""
    from m3serve.layers import dispatch
    from m3serve.llm import LLM
    from m3serve.model.formats.layouts import dequantized_checkpoint
    from test_quant_e2e import assert_reference_greedy, serve

    path = quant_dir(fmt, flavor)
    dispatch.executed.clear()
    llm = LLM(model=str(path), dtype="float32", device="cuda", max_num_batched_tokens=32,
              max_num_seqs=4, kv_cache_memory=1 << 28)
    served = serve(llm)
    assert llm.engine.worker.runner.num_graph_steps > 0
    paths = dispatch.summary()
    assert paths["moe"] == "triton" and "packed_moe" not in paths, paths
    if fmt.startswith("mxfp8"):
        assert paths["packed_linear"] == "triton", paths
    assert_reference_greedy(dequantized_checkpoint(path), llm.engine.model_config, served)
    del llm
    torch.cuda.empty_cache()



def _tiny_fp8_tokens(tiny_dir, device, gaps=False):
    """Greedy tokens of six prompts with online FP8; with `gaps`, per prompt (tokens, the top-2
    logprob gap at each position) instead."""
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    from test_engine import prompts
    ps = [{"prompt_token_ids": p} for p in prompts((5, 37, 80, 150, 9, 120))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2 if gaps else None)
    if device == "cpu":
        llm = LLM(model=str(tiny_dir), dtype="float32", device="cpu", enforce_eager=True, quantization="fp8")
    else:
        llm = LLM(model=str(tiny_dir), dtype="float32", device="cuda", max_num_batched_tokens=48,
                  kv_cache_memory=1 << 28, quantization="fp8")
    outs = [o.outputs[0] for o in llm.generate(ps, params, use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    if not gaps:
        return [o.token_ids for o in outs]
    runs = []
    for o in outs:
        top = [sorted((e.logprob for e in entry.values()), reverse=True) for entry in o.logprobs]
        runs.append((list(o.token_ids), [t[0] - t[1] for t in top]))
    return runs


def _agree_to_near_ties(runs, want, near_tie):
    """Each prompt's greedy tokens equal `want`'s (per prompt (tokens, top-2 gaps)), or first
    differ where either run's top two logprobs are within `near_tie` nats (after that the
    contexts differ). Returns how many prompts differed."""
    differed = 0
    for i, ((got, got_gaps), (ref, ref_gaps)) in enumerate(zip(runs, want)):
        first = next((t for t, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if first is None:
            continue
        differed += 1
        gap = min(got_gaps[first], ref_gaps[first])
        assert gap < near_tie, (f"prompt {i}: token {first} differs ({got[first]} against {ref[first]}) "
                                f"where the top two logprobs are {gap:.4f} apart")
    return differed


def test_tiny_online_fp8_decode_gemm_greedy_equals_scaled_mm(tiny_dir, monkeypatch):
    """Online FP8 (`quantization="fp8"`), float32 activations: with M3SERVE_FP8_DECODE_GEMM=1
    decode rows take the split-K FP8 GEMM (kernels/fp8_decode.py, the tiny weights being narrow);
    the greedy tokens equal those of quantisation + _scaled_mm (the same quantised operands)
    up to near ties: cuBLAS's FP8 product accumulates with fewer bits than the split-K one
    (measured: one bf16 ulp at the rank's shapes), which decides a near tie of the random
    model's logits either way, the difference carried on through the KV cache (on an H100 the
    first difference came at the tenth token of one prompt, where the top two logprobs were
    0.051 nats apart)."""
    from m3serve import envs
    from m3serve.layers import dispatch
    from m3serve.kernels import fp8_decode
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(envs, "FP8_DECODE_GEMM", on)
        monkeypatch.setattr(fp8_decode, "MIN_K", 1)          # the tiny model's K is small
        dispatch.executed.clear()
        runs[on] = _tiny_fp8_tokens(tiny_dir, "cuda", gaps=True)
        assert (dispatch.summary().get("fp8_decode_gemm") == "triton") == on
    assert _agree_to_near_ties(runs[True], runs[False], near_tie=0.1) <= 2


def _greedy_with_logprobs(model_dir, monkeypatch, pdl_on, **flags):
    """Greedy tokens and their top-3 logprobs of six prompts with M3SERVE_PDL on or off (CUDA
    graphs for the decode steps, eager prompt steps)."""
    from m3serve import envs
    from m3serve.kernels import pdl
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    from test_engine import prompts
    monkeypatch.setattr(envs, "PDL", pdl_on)
    import importlib
    launches, real = [], pdl.launch_options
    for name in ("rmsnorm", "qk_norm_rope", "indexer", "paged_attention", "fused_moe", "gemv",
                 "step_inputs", "swiglu"):          # each binds launch_options at import
        monkeypatch.setattr(importlib.import_module(f"m3serve.kernels.{name}"), "launch_options",
                            lambda on: launches.append(on) or real(on))
    llm = LLM(model=str(model_dir), device="cuda", max_num_batched_tokens=256, max_model_len=1024,
              kv_cache_memory=1 << 30, **flags)
    ps = [{"prompt_token_ids": p} for p in prompts((5, 37, 80, 150, 9, 120))]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
                        use_tqdm=False)
    assert llm.engine.worker.runner.num_graph_steps > 10
    assert launches and all(launches) == pdl_on and any(launches) == pdl_on     # every launch, or none
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [(list(o.outputs[0].token_ids),
             [sorted((t, e.logprob) for t, e in d.items()) for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("model", ["tiny", "rank8_l4"])
def test_pdl_graph_replay_bit_identical(tiny_dir, tmp_path, monkeypatch, model):
    """The decode kernels launched with programmatic dependent launch (programmatic edges in the
    captured graphs; every PDL-capable launch takes it) compute what they compute without it:
    the same greedy tokens, logprobs equal to 2e-5 relative (the decode MoE sums its experts
    with fp32 atomics, whose order may change from run to run with or without PDL; measured on
    an H100: bit-identical on the tiny model, 4.4e-5 absolute / 6.4e-6 relative at the rank's
    shapes), bf16, on the tiny model and 4 layers of one TP 8 rank's
    real shapes (dummy weights; the full-width 4 layers are ~58 GB, two engines of them one
    after the other ran out of an H100's memory)."""
    from m3serve.kernels import pdl
    if not pdl.SUPPORTED or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper and a Triton that has it")
    if model == "tiny":
        model_dir, flags = tiny_dir, dict(dtype="bfloat16")
    else:
        from m3serve.bench.realshape import write_realshape_dir
        model_dir, flags = (write_realshape_dir(tmp_path / "rs", num_layers=4, tp_rank=8),
                            dict(load_format="dummy"))
    off = _greedy_with_logprobs(model_dir, monkeypatch, False, **flags)
    on = _greedy_with_logprobs(model_dir, monkeypatch, True, **flags)
    assert [tokens for tokens, _ in on] == [tokens for tokens, _ in off]
    for (_, got), (_, want) in zip(on, off):
        for g, w in zip(got, want):
            assert [t for t, _ in g] == [t for t, _ in w]
            torch.testing.assert_close(torch.tensor([v for _, v in g]), torch.tensor([v for _, v in w]),
                                       rtol=2e-5, atol=1e-5)


def _heldout_nll(device, quantization):
    """Per-token negative log-likelihood of four 300-token pieces of the trained tiny model's
    held-out text (prompt logprobs: teacher-forced, so every position sees the same context on
    every path), float32 activations."""
    from tokenizers import Tokenizer
    from m3serve.llm import LLM
    from m3serve.model.files import TRAINED_TINY_DIR
    from m3serve.sampling_params import SamplingParams
    ids = Tokenizer.from_file(str(TRAINED_TINY_DIR / "tokenizer.json")).encode(
        (TRAINED_TINY_DIR / "heldout.txt").read_text()).ids
    ps = [{"prompt_token_ids": ids[o:o + 300]} for o in (0, 1000, 2500, 4000)]
    kw = {} if device == "cpu" else dict(max_num_batched_tokens=128, kv_cache_memory=1 << 28)
    llm = LLM(model=str(TRAINED_TINY_DIR), dtype="float32", device=device, enforce_eager=device == "cpu",
              quantization=quantization, **kw)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return torch.tensor([-entry[t].logprob for p, o in zip(ps, outs)
                         for t, entry in zip(p["prompt_token_ids"][1:], o.prompt_logprobs[1:])],
                        dtype=torch.float64)


def test_trained_tiny_online_fp8_gpu_perplexity_equals_cpu_reference():
    """Online FP8 on the GPU path against the CPU reference (the same quantised operands, products
    in fp64), by per-token NLL on held-out text. Token-for-token equality is no test for FP8
    at this scale: FP8 rounding, the indexer's block top-k and the router's top-k are discrete,
    so rounding noise far below what any GPU product differs by moves them. Measured on the CPU
    with the trained tiny model: a 1e-6 relative perturbation of every activation before its FP8
    quantisation moves the mean |dNLL| by 0.082 nats (p99 0.71) and the perplexity by 0.6 %;
    1e-5: 0.118 and 1.2 %; 1e-4: 0.135 and 0.6 %; 1e-3: 0.146 and 1.9 %; the FP8 model against
    the unquantised one: 0.180 and 1.7 %. (On an H100 the random tiny model's greedy tokens left
    the CPU's at the first token in 4 of 6 prompts with every op on its PyTorch reference and
    the FP8 products in fp64: docs/performance.md.) So: perplexities within 2.5 % and a mean
    |dNLL| of at most 0.16 (noise up to 1e-3, which covers FP8 tensor-core accumulation; a
    wrong scale or a missing expert is far outside), and the GPU's FP8 NLL nearer the CPU's
    FP8 than the unquantised model's (which tells FP8 from no quantisation)."""
    import math
    gpu, cpu, unquantised = _heldout_nll("cuda", "fp8"), _heldout_nll("cpu", "fp8"), _heldout_nll("cpu", None)
    ppl = lambda nll: math.exp(nll.mean().item())
    to_cpu, to_unquantised = (gpu - cpu).abs().mean().item(), (gpu - unquantised).abs().mean().item()
    print(f"FP8 NLL per token, GPU against the CPU: mean |d| {to_cpu:.4f}, against the unquantised model "
          f"{to_unquantised:.4f}; perplexity GPU {ppl(gpu):.3f}, CPU {ppl(cpu):.3f}, unquantised {ppl(unquantised):.3f}")
    assert abs(ppl(gpu) / ppl(cpu) - 1) < 0.025
    assert to_cpu <= 0.16
    assert to_cpu < to_unquantised


def test_tiny_online_fp8_norm_made_fp8_inputs_change_nothing(tiny_dir, monkeypatch):
    """Online FP8: the norms before the qkv projection and the FP8 experts make their per-token
    FP8 inputs (one launch fewer each); the greedy tokens are those of the projection and the
    experts quantising for themselves (the same bits)."""
    from m3serve.kernels import rmsnorm
    from m3serve.layers import moe
    from m3serve.model import minimax_m3
    calls, real = [], rmsnorm.fused_add_rms_norm_fp8
    monkeypatch.setattr(rmsnorm, "fused_add_rms_norm_fp8", lambda *a: calls.append(1) or real(*a))
    fused = _tiny_fp8_tokens(tiny_dir, "cuda")
    assert calls                                  # the norms made the FP8 inputs
    monkeypatch.setattr(minimax_m3, "takes_fp8_input", lambda module, x: False)
    monkeypatch.setattr(moe.MoE, "takes_fp8_input", lambda self, x: False)
    assert _tiny_fp8_tokens(tiny_dir, "cuda") == fused
