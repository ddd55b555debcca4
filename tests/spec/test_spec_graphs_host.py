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


@pytest.mark.parametrize("method", ["greedy", "greedy-true-stand-ins", "seeded", "synthetic"])
@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_stand_in_drafts_replay_the_verify_graph_and_are_never_kept(tiny_dir, drafts, method, kind):
    """Decodes that switch from plain steps to drafts (disable_by_batch_size 3, the batch
    shrinking as requests finish) have no drafts yet: with `pad_drafts` they verify k stand-in
    tokens, so the step replays the verify graph instead of running the target eagerly. A
    stand-in is never kept, whatever the rule (even synthetic acceptance with every draft kept),
    never counts as a draft, and the tokens are those of the step without stand-ins: greedy
    equals speculation off, seeded draws equal between graph and eager steps.
    `greedy-true-stand-ins`: the stand-ins are the true greedy continuation, which a verify
    that kept them would accept."""
    k = 3
    prompts = [[(5 * i + 2 * j) % 400 + 11 for j in range(10 + 7 * i)] for i in range(5)]
    lens = [3, 5, 8, 12, 18]
    plain = LLM(str(tiny_dir), dtype="float32")
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                          use_tqdm=False)]
    truth = {tuple(p): list(w) for p, w in zip(prompts, want)}
    sampled = dict(temperature=0.9, top_p=0.95, seed=5) if method == "seeded" else dict(temperature=0)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **sampled) for n in lens]
    spec = ({"method": "eagle3", "model": str(drafts[kind])} if kind == "eagle3" else {"method": "dspark"})
    spec.update(num_speculative_tokens=k, disable_by_batch_size=3)
    if method == "synthetic":
        spec.update(rejection_sample_method="synthetic", synthetic_acceptance_length=k + 1.0)   # keeps all
    results = []
    for graphs in (False, True):
        llm = LLM(str(drafts[kind] if kind == "dspark" else tiny_dir), dtype="float32", max_num_seqs=8,
                  speculative_config=spec)
        runner, sched = llm.engine.worker.runner, llm.engine.core.scheduler
        sched.pad_drafts = 8                   # the largest verify graph below
        if method == "greedy-true-stand-ins":
            sched._stand_ins = lambda r: (truth[tuple(r.prompt_token_ids)][r.num_output_tokens:] + [1] * k)[:k]
        if graphs:
            runner.spec_graphs = EagerReplaySpecGraphs(runner.model, runner.proposer, runner.buffers,
                                                       [1, 2, 4, 8], k, runner.max_model_len)
            runner.spec_graphs.capture(runner.batch)
        seen = {"padded": 0, "real": 0, "padded_graph": 0}
        update, graph_step = sched.update_from_output, runner._speculative_graph_step

        def recording_update(so, out, update=update, seen=seen):
            index = {r: i for i, r in enumerate(out.req_ids)}
            for r, d in so.scheduled_spec_decode_tokens.items():
                if r in index and r in so.padded_drafts:
                    seen["padded"] += 1
                    assert len(out.sampled_token_ids[index[r]]) == 1, "a stand-in draft was kept"
                elif r in index and d:
                    seen["real"] += 1
            return update(so, out)

        def recording_graph_step(so, batch, b, graph_step=graph_step, seen=seen):
            seen["padded_graph"] += bool(so.padded_drafts)
            return graph_step(so, batch, b)
        sched.update_from_output, runner._speculative_graph_step = recording_update, recording_graph_step
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        assert seen["padded"] > 0 and sched.num_padded_drafts == seen["padded"]
        assert sched.spec_stats.num_drafts == seen["real"]
        assert (seen["padded_graph"] > 0) == graphs
        _check_clean_pools(llm)
    assert results[0] == results[1]
    if method.startswith("greedy"):
        assert results[0] == want


def _check_clean_pools(llm):
    from test_spec_engine import _check_clean
    _check_clean(llm)
