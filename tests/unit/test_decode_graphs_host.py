"""The host side of the decode CUDA graphs on CPU: the shared staging buffers, padding rows, the
block-table rows left over from earlier (longer) requests, and the in-graph argmax. The graph is
replaced by an eager run of exactly the captured function over the same staged buffers, so every
input the model sees comes through the graph path; outputs must equal the plain eager engine's."""
import pytest
import torch

from m3serve.layers import probes
from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams
from m3serve.worker.cuda_graphs import DecodeGraphs


class _EagerGraph:
    """Stands in for a captured CUDA graph: `replay` reruns the captured function eagerly and
    writes its results into the tensors the capture produced (the graph's static outputs and
    the tensors the layers reported), as a real replay rewrites them in place."""

    def __init__(self, graphs, b, outputs):
        self.graphs, self.b, self.outputs = graphs, b, outputs

    def replay(self):
        g, b = self.graphs, self.b
        fresh = probes.GraphReports()
        with fresh.collect(b):
            outputs = g.forward(b, g.buffers.seq_lens[:b].tolist())
        static = g.reports.reports(b)
        assert [r[:2] for r in fresh.reports(b)] == [r[:2] for r in static]
        for (_, _, old), (_, _, new) in zip(static, fresh.reports(b)):
            old.copy_(new)
        for old, new in zip(self.outputs, outputs):
            old.copy_(new)


class EagerReplayGraphs(DecodeGraphs):
    """DecodeGraphs whose graphs run the captured function eagerly (the real `replay`)."""

    def capture(self, input_batch) -> None:
        self.buffers.stage(None, input_batch, pad_to=self.sizes[-1])
        for b in self.sizes:
            with self.reports.collect(b):
                outputs = self.forward(b, self.buffers.seq_lens[:b].tolist())
            self.graphs[b] = (_EagerGraph(self, b, outputs), *outputs)


def graphed_llm(tiny_dir, **flags) -> LLM:
    llm = LLM(model=str(tiny_dir), max_num_seqs=8, **flags)
    runner = llm.engine.worker.runner
    runner.graphs = EagerReplayGraphs(runner.model, runner.buffers, [1, 2, 4, 8], runner.max_model_len)
    runner.graphs.capture(runner.batch)
    return llm


@pytest.fixture(scope="module")
def engines(tiny_dir):
    return LLM(model=str(tiny_dir), max_num_seqs=8), graphed_llm(tiny_dir)


def test_staged_decode_equals_eager(engines):
    plain, graphed = engines
    # ragged lengths across several blocks, 3 and 5 requests (padded to 4 and 8); the short batch
    # runs after the long one so stale block-table rows are present
    long = [[(7 * i + 3 * j) % 500 + 10 for j in range(20 + 23 * i)] for i in range(5)]
    short = [[(11 * i + j) % 300 + 20 for j in range(3 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for batch in (long, short):
        prompts = [{"prompt_token_ids": p} for p in batch]
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
        assert got == want
    runner = graphed.engine.worker.runner
    assert runner.num_graph_steps >= 2 * 11 and runner.num_eager_steps >= 2


class _Cloning:
    """A probe that keeps a copy of every report (graph replays rewrite what they report)."""

    def __init__(self):
        self.reports = []

    def record(self, name, layer_id, tensor):
        self.reports.append((name, layer_id, tensor.clone()))


def test_graph_replays_report_what_eager_steps_do(engines):
    """The layers' reports (layers/probes.py) reach an installed probe after each graph replay,
    cut to the step's real requests, and equal the eager engine's step by step; the bench's
    measured-experts roofline reads them."""
    plain, graphed = engines
    prompts = [{"prompt_token_ids": [(5 * i + j) % 400 + 3 for j in range(9 + 40 * i)]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    seen = []
    for llm in (plain, graphed):
        before = llm.engine.worker.runner.num_graph_steps
        with probes.installed(_Cloning()) as probe:
            llm.generate(prompts, params, use_tqdm=False)
        seen.append((probe.reports, llm.engine.worker.runner.num_graph_steps - before))
    (eager, no_graphs), (graph, graph_steps) = seen
    assert no_graphs == 0 and graph_steps >= 4
    assert probes.active is None
    cfg = plain.engine.model_config
    per_step = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers)) + len(cfg.sparse_layer_ids)
    assert len(eager) == len(graph) and len(eager) % per_step == 0
    names = {probes.ROUTED_EXPERTS: 0, probes.SPARSE_BLOCKS: 0}
    for (name, layer, want), (name_g, layer_g, got) in zip(eager, graph):
        assert (name_g, layer_g) == (name, layer)
        assert got.shape == want.shape and torch.equal(got.long(), want.long()), (name, layer)
        names[name] += 1
    assert all(names.values())
    # decode steps of 3 requests padded to a graph of 4: three rows each
    assert graph[-1][2].shape[0] == 3


def test_staged_decode_sampled_path_uses_logits(engines):
    """Non-greedy requests read the graph's logits (not its argmax): seeded sampling agrees."""
    plain, graphed = engines
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [40, 41, 42]}]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=123, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_prompt_logprobs_of_one_token_chunks_in_graph_steps(engines, tiny_dir):
    """A step where every request computes one token is a graph step, also when that token is
    a one-token chunk of a prompt that asked for prompt logprobs (a budget of one token per
    step makes every prefill step one): the graph's hidden states serve them."""
    plain, _ = engines
    graphed = graphed_llm(tiny_dir, max_num_batched_tokens=1)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    prompt = [{"prompt_token_ids": [9, 8, 7, 6, 5]}]
    want = plain.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
    got = graphed.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
    assert len(got) == len(want) == 5 and got[0] is None
    for a, b in zip(got[1:], want[1:]):
        assert {k: round(v.logprob, 5) for k, v in a.items()} == {k: round(v.logprob, 5) for k, v in b.items()}
    runner = graphed.engine.worker.runner
    assert runner.num_graph_steps >= 6 and runner.num_eager_steps == 0


def test_warm_up_forwards_touch_only_the_null_page(engines):
    """The start-up warm-up runs prompts, mixed steps and short chunks at the end of long
    contexts on the null page: the cached blocks (K/V and index keys) of earlier requests keep
    their contents, and the next requests give the same tokens."""
    import torch
    plain, _ = engines
    runner = plain.engine.worker.runner
    prompts = [{"prompt_token_ids": [(5 * j) % 400 + 3 for j in range(150)]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = plain.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    caches = [c for c in (*runner.kv_caches, *runner.index_caches) if c is not None]
    blocks = [c[:, 1:] if c.dim() == 5 else c[1:] for c in caches]      # every block but 0
    before = [b.clone() for b in blocks]
    shapes = runner.warm_up_shapes(300)
    moe = next(layer.mlp for layer in runner.model.model.layers if layer.is_moe)
    cfg = moe.cfg
    assert ([16], [16]) in shapes and ([300], [300]) in shapes
    assert ([300 - 8] + [1] * 7, [300 - 8] + [1] * 7) in shapes          # 299 tokens: not % 16
    assert all(sum(q) <= 300 for q, _ in shapes)
    regime = min(16 * cfg.num_local_experts // cfg.num_experts_per_tok, 300)
    assert ([regime], [regime]) in shapes
    context = runner.buffers.max_blocks * runner.block_size            # 131072 for the tiny model
    assert ([16], [context]) in shapes                                 # a wider top-k bucket
    runner.warm_up(shapes)
    assert all(torch.equal(a, b) for a, b in zip(before, blocks))
    assert plain.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids == first


def test_null_rows_must_fit_the_buffers(engines):
    buffers = engines[0].engine.worker.runner.buffers
    with pytest.raises(ValueError, match="do not fit"):
        buffers.stage_null([buffers.max_tokens + 1])
    with pytest.raises(ValueError, match="do not fit"):
        buffers.stage_null([])
    with pytest.raises(ValueError, match="do not fit"):
        buffers.stage_null([4], [3])                                   # context shorter than the query
