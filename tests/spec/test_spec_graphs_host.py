"""The speculative CUDA-graph step on CPU: the verify and draft graphs are replaced by eager
runs of exactly the captured functions over the same staged buffers (padding rows of k + 1
tokens, acceptance decided on the device between them), so every input the graphs would see
comes through that path; greedy and seeded outputs must equal the eager speculative engine's
and speculation off."""
import pytest

from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams
from m3serve.worker.spec_graphs import SpecDecodeGraphs


class EagerReplaySpecGraphs(SpecDecodeGraphs):
    def capture(self, input_batch) -> None:
        self.buffers.stage(None, input_batch, pad_to=self.sizes[-1], pad_query_len=self.q)
        self.verify_graphs = {b: None for b in self.sizes}
        self.replays = 0

    def verify(self, b, num_reqs):
        self.replays += 1
        self._outputs = self.verify_forward(b, self.buffers.seq_lens[:b].tolist())
        return self._outputs

    def draft(self, b, num_reqs):
        last = (self._outputs[4][self.last_index[:b]]).tolist()
        return self.draft_forward(b, self._outputs[1], self.buffers.seq_lens[:b].tolist(), last)


def _spec_llm(tiny_dir, draft, graphs: bool, k=3, kind="eagle3"):
    spec = ({"method": "eagle3", "model": str(draft), "num_speculative_tokens": k} if kind == "eagle3"
            else {"method": "dspark", "num_speculative_tokens": k})     # draft: a target with dspark/
    llm = LLM(str(draft if kind == "dspark" else tiny_dir), dtype="float32", max_num_seqs=8,
              speculative_config=spec)
    if graphs:
        runner = llm.engine.worker.runner
        runner.spec_graphs = EagerReplaySpecGraphs(runner.model, runner.proposer, runner.buffers, [1, 2, 4, 8],
                                                   k, runner.max_model_len)
        runner.spec_graphs.capture(runner.batch)
    return llm


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=14,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_graph_step_equals_eager_step(tiny_dir, drafts, params, kind):
    from test_spec_engine import _oracle

    prompts = [[(7 * i + 3 * j) % 500 + 10 for j in range(20 + 23 * i)] for i in range(5)]
    plain = LLM(str(tiny_dir), dtype="float32")
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts],
                                                          SamplingParams(temperature=0, max_tokens=14,
                                                                         ignore_eos=True), use_tqdm=False)]
    results = []
    for graphs in (False, True):
        llm = _spec_llm(tiny_dir, drafts[kind], graphs, kind=kind)
        _oracle(llm, {tuple(p): p + w for p, w in zip(prompts, want)}, 3)   # long accepted runs
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        stats = llm.engine.core.scheduler.spec_stats
        assert stats.num_drafts > 10 and (params.temperature > 0 or stats.num_accepted_tokens > 0)
        if graphs:
            assert llm.engine.worker.runner.spec_graphs.replays > 5
    assert results[0] == results[1]
    if params.temperature == 0:
        assert results[0] == want
