"""The speculative CUDA-graph step on CPU: the verify and draft graphs are replaced by eager
runs of exactly the captured functions over the same staged buffers (padding rows of q tokens,
acceptance decided on the device between them), so every input the graphs would see comes
through that path; greedy and seeded outputs must equal the eager speculative engine's and
speculation off -- at every query width the rules use: k + 1, the narrower widths of the
measured gate, and the switch step's 1. And the capture plan: every capture size at every
width the engine's rule may use."""
from collections import Counter

import pytest

from m3serve.core.spec_gate import draft_widths
from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams
from m3serve.worker.spec_graphs import SpecDecodeGraphs, spec_graph_plan, spec_graph_widths


class EagerReplaySpecGraphs(SpecDecodeGraphs):
    def capture(self, input_batch) -> None:
        self.verify_graphs = {p: None for p in spec_graph_plan(self.sizes, self.widths)}
        self.replays = Counter()          # query width -> replays

    def verify(self, b, q, num_reqs):
        assert (b, q) in self.verify_graphs
        self.replays[q] += 1
        self._outputs = self.verify_forward(b, q, self.buffers.seq_lens[:b].tolist())
        return self._outputs

    def draft(self, b, q, num_reqs):
        last = (self._outputs[4][self.last_index[:b]]).tolist()
        return self.draft_forward(b, q, self._outputs[1], self.buffers.seq_lens[:b].tolist(), last)


def _graphs(llm, k, rule="always"):
    runner = llm.engine.worker.runner
    runner.spec_graphs = EagerReplaySpecGraphs(runner.model, runner.proposer, runner.buffers, [1, 2, 4, 8],
                                               k, runner.max_model_len, spec_graph_widths(k, rule))
    runner.spec_graphs.capture(runner.batch)
    return runner.spec_graphs


def oracle_drafts(llm, continuations: dict[tuple, list[int]], k: int) -> None:
    """Make the draft graph's proposals the true continuation with planted mistakes, as
    test_spec_engine's `_oracle` makes the eager proposer's (replays on CPU or on a GPU)."""
    import torch

    runner = llm.engine.worker.runner
    g, state = runner.spec_graphs, {}
    step, verify, draft = runner._speculative_graph_step, g.verify, g.draft

    def graph_step(so, batch, b, q):
        state["rows"] = batch.rows.tolist()
        return step(so, batch, b, q)

    def verify_(b, q, num_reqs=None):
        state["out"] = verify(b, q, num_reqs)
        return state["out"]

    def draft_(b, q, num_reqs=None):
        out = draft(b, q, num_reqs).clone()
        last = state["out"][4][g.last_index[:b]].tolist()
        batch = runner.batch
        for i, row in enumerate(state["rows"]):
            seq = continuations.get(tuple(batch.token_ids[row, :int(batch.num_prompt_tokens[row])].tolist()))
            if seq is None:
                continue
            pos = last[i] + 2
            toks = (seq[pos:pos + k] + [1] * k)[:k]
            if (pos // 3) % 3 == 2:
                toks[-1] = (toks[-1] + 1) % 2048
            out[i] = torch.tensor(toks)
        return out
    runner._speculative_graph_step, g.verify, g.draft = graph_step, verify_, draft_


def _spec_llm(tiny_dir, draft, graphs: bool, k=3, kind="eagle3"):
    spec = ({"method": "eagle3", "model": str(draft), "num_speculative_tokens": k} if kind == "eagle3"
            else {"method": "dspark", "num_speculative_tokens": k})     # draft: a target with dspark/
    llm = LLM(str(draft if kind == "dspark" else tiny_dir), dtype="float32", max_num_seqs=8,
              speculative_config=spec)
    if graphs:
        _graphs(llm, k)
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
            assert llm.engine.worker.runner.spec_graphs.replays[4] > 5
    assert results[0] == results[1]
    if params.temperature == 0:
        assert results[0] == want


@pytest.mark.parametrize("method", ["greedy", "seeded", "synthetic", "logprobs"])
@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_switch_steps_replay_the_switch_graph(tiny_dir, drafts, method, kind):
    """Decodes that switch from plain steps to drafts (disable_by_batch_size 3, the batch
    shrinking as requests finish) have no drafts yet: the step replays the switch graph (query
    width 1: each request's next token, then the draft pass) instead of running the target
    eagerly, and each request samples as an eager step samples one without drafts: greedy
    equals speculation off, seeded draws equal between graph and eager steps, synthetic
    acceptance keeps nothing there; a request asking for logprobs keeps every step it is in
    eager (the graph step computes none), switch steps too, with the same logprobs."""
    k = 3
    prompts = [[(5 * i + 2 * j) % 400 + 11 for j in range(10 + 7 * i)] for i in range(5)]
    lens = [3, 5, 8, 12, 18]
    plain = LLM(str(tiny_dir), dtype="float32")
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                          use_tqdm=False)]
    sampled = dict(temperature=0.9, top_p=0.95, seed=5) if method == "seeded" else dict(temperature=0)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **sampled) for n in lens]
    if method == "logprobs":
        params[4] = SamplingParams(max_tokens=lens[4], ignore_eos=True, temperature=0, logprobs=2)
    spec = ({"method": "eagle3", "model": str(drafts[kind])} if kind == "eagle3" else {"method": "dspark"})
    spec.update(num_speculative_tokens=k, disable_by_batch_size=3)
    if method == "synthetic":
        spec.update(rejection_sample_method="synthetic", synthetic_acceptance_length=k + 1.0)   # keeps all
    results = []
    for graphs in (False, True):
        llm = LLM(str(drafts[kind] if kind == "dspark" else tiny_dir), dtype="float32", max_num_seqs=8,
                  speculative_config=spec)
        runner = llm.engine.worker.runner
        g = _graphs(llm, k, rule="fixed") if graphs else None
        switches = {"steps": 0, "kept": 0}
        execute = runner.execute_model

        def recording(so, dp=None, execute=execute, switches=switches):
            out = execute(so, dp)
            decodes = so.speculate and so.num_scheduled_tokens and not so.scheduled_spec_decode_tokens and all(
                n == 1 for n in so.num_scheduled_tokens.values())
            if decodes and out is not None:
                switches["steps"] += 1
                switches["kept"] += sum(len(t) - 1 for t in out.sampled_token_ids)
            return out
        runner.execute_model = recording
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        assert switches["steps"] > 0 and switches["kept"] == 0
        if graphs and method == "logprobs":      # it runs throughout: no step may replay a graph
            assert not g.replays
        elif graphs:
            assert g.replays[1] > 0 and g.replays[k + 1] > 0
        _check_clean_pools(llm)
    assert results[0] == results[1]
    if method in ("greedy", "logprobs"):
        assert [t for t, _ in results[0]] == want


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_narrower_widths_replay_their_graphs(tiny_dir, drafts, kind):
    """The measured gate under a fake clock where verifying one draft costs little and more
    cost much, with drafts that are the true continuation: its steps verify k = 4, 3 and 1
    drafts (exploring) and then 1, each replaying the graph of its query width, the first
    after plain steps the switch graph; greedy outputs equal speculation off and the eager
    engine's."""
    from test_spec_engine import _oracle

    from m3serve.core.spec_gate import SpeculationGate
    k = 4
    prompts = [[(3 * i + 5 * j) % 300 + 17 for j in range(8 + 3 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = LLM(str(tiny_dir), dtype="float32")
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
    spec = ({"method": "eagle3", "model": str(drafts[kind])} if kind == "eagle3" else {"method": "dspark"})
    spec.update(num_speculative_tokens=k)
    results = []
    for graphs in (False, True):
        llm = LLM(str(drafts[kind] if kind == "dspark" else tiny_dir), dtype="float32", max_num_seqs=8,
                  speculative_config=spec)
        g = _graphs(llm, k, rule="measured") if graphs else None
        truth = {tuple(p): p + w for p, w in zip(prompts, want)}
        _oracle(llm, truth, k)                              # long accepted runs, eager and graph steps
        if graphs:
            oracle_drafts(llm, truth, k)
        core, now = llm.engine.core, [0.0]
        execute = core.executor.execute_model
        core.scheduler.spec_gate = SpeculationGate(k, measured=True, clock=lambda: now[0])

        def timed(step, execute=execute, now=now):
            width = max((len(d) for d in step.scheduled_spec_decode_tokens.values()), default=0)
            now[0] += 1.0 + (0.1 if width <= 1 else 5.0)
            return execute(step)
        core.executor.execute_model = timed
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        if graphs:
            assert {q - 1 for q, n in g.replays.items() if n} >= set(draft_widths(k))
            assert g.replays[1] > 0 and g.replays[2] >= 4 + 3           # the switch, then 1 draft
        _check_clean_pools(llm)
    assert results[0] == results[1] == want


@pytest.mark.parametrize("k", range(1, 9))
def test_the_plan_covers_every_width_and_size_the_rule_may_use(k):
    """Every capture size, at every query width the rule may ask for: the verify of all k
    drafts, the switch step (speculating, no drafts yet) where plain steps occur, and under the
    measured rule each width of drafts it chooses between; captured the most tokens first."""
    sizes = [1, 2, 4, 8, 16, 32, 48, 64]
    for rule, verified in [("always", {k}), ("fixed", {k, 0}), ("measured", {*draft_widths(k), 0})]:
        plan = spec_graph_plan(sizes, spec_graph_widths(k, rule))
        assert set(plan) == {(b, j + 1) for b in sizes for j in verified}, rule
        tokens = [b * q for b, q in plan]
        assert tokens == sorted(tokens, reverse=True) and len(plan) == len(set(plan))


def _check_clean_pools(llm):
    from test_spec_engine import _check_clean
    _check_clean(llm)
