"""The decode CUDA graphs' host side with cross-layer top-k reuse (on CPU, the graph replaced by an
eager run of exactly the captured function over the staged buffers): padded decode batches give
the plain reuse engine's tokens, and every sparse layer reports a selection per step, the skipping
layers the one their indexer layer handed over inside the captured forward."""
import torch

from m3serve.layers import probes
from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams
from test_decode_graphs_host import _Cloning, graphed_llm

REUSE = {"text_config": {"use_index_cache": True, "index_topk_freq": 2}}    # layers 1 and 3 index


def test_graphed_decode_with_reuse_equals_eager(tiny_dir):
    plain = LLM(model=str(tiny_dir), max_num_seqs=8, hf_overrides=REUSE)
    graphed = graphed_llm(tiny_dir, hf_overrides=REUSE)
    # contexts past top-4 x 16 tokens, 3 requests padded to a graph of 4
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 10 for j in range(70 + 23 * i)]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seen = []
    for llm in (plain, graphed):
        with probes.installed(_Cloning()) as probe:
            out = llm.generate(prompts, params, use_tqdm=False)
        seen.append(([o.outputs[0].token_ids for o in out], probe.reports))
    (want, eager), (got, graph) = seen
    assert got == want
    assert graphed.engine.worker.runner.num_graph_steps >= 7
    blocks = [(layer, t) for name, layer, t in graph if name == probes.SPARSE_BLOCKS]
    assert [layer for layer, _ in blocks[:3]] == [1, 2, 3]
    for i in range(0, len(blocks), 3):                      # layer 2 attends with layer 1's choice
        assert torch.equal(blocks[i][1], blocks[i + 1][1])
    assert [(n, lid, t.shape) for n, lid, t in graph] == [(n, lid, t.shape) for n, lid, t in eager]
    assert all(torch.equal(a[2], b[2]) for a, b in zip(graph, eager))
