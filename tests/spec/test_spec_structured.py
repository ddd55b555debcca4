"""Structured outputs with speculative decoding on the tiny model: the grammar's mask is applied
at every verified position for the grammar state after the drafts before it, and the matcher
advances over the emitted tokens only. Greedy outputs equal speculation off token for token
(JSON schema, regex, a forced tool call; n = 2; EAGLE3, MTP and DSpark; eager verification and the
speculative graph step) with drafts that are the true continuation except for planted mistakes
the grammar allows (a matcher advanced over rejected drafts would drift) and ones it refuses;
a grammar ending inside an accepted block stops right at its stop token; sampled outputs always
satisfy their grammar. Every run ends with the KV pool whole."""
import json
import re

import pytest
import torch

from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams, StructuredOutputsParams
from test_spec_engine import _check_clean, _flags, _spec

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar")

COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["color", "n"], "additionalProperties": False}
REGEX = r"[a-z]{2,6}( [a-z]{1,5}){2,5}\."
DOOR = {"type": "function", "function": {"name": "lock_door", "parameters": {
    "type": "object", "required": ["locked"], "properties": {"locked": {"type": "boolean"}}}}}
K = 3


def _constraints() -> dict[str, StructuredOutputsParams]:
    from m3serve.structured.tool_grammar import tool_call_grammar

    return {"json": StructuredOutputsParams(json=COLOR, disable_any_whitespace=True),
            "regex": StructuredOutputsParams(regex=REGEX),
            "tool": StructuredOutputsParams(grammar=tool_call_grammar([DOOR], "required", "disabled"))}


def _requests(temperature=0.0, seed=None):
    """(prompt, params) per constrained request: one per constraint, plus a second JSON one with
    n = 2 (each child has its own matcher). Distinct prompts, so the oracle finds each one's
    continuation by its prompt."""
    out = []
    for c, (name, spec) in enumerate([*_constraints().items(), ("json", _constraints()["json"])]):
        prompt = [(11 * c + 3 * t) % 1900 + 20 for t in range(9 + 13 * c)]
        # a forced tool call's markup is long in the tiny vocabulary, and "required" may repeat
        # its invoke: cut short (still constrained at every token)
        out.append((prompt, SamplingParams(temperature=temperature, max_tokens=40 if name == "tool" else 32,
                                           n=2 if c == 3 else 1, seed=seed, structured_outputs=spec)))
    return out


def _generate(llm, requests):
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    requests = _requests()
    llm = LLM(str(tiny_dir), **_flags())
    want = _generate(llm, requests)
    return requests, want, llm.engine.eos_token_id


class Oracle:
    """Drafts that are each request's true (speculation-off) continuation, with planted
    mistakes: at some positions the last draft is replaced by another token its grammar allows
    there (rejected by the target, accepted by the grammar), at others the second draft by a
    token its grammar refuses."""

    def __init__(self, llm, requests, want, eos: int, tiny_dir, mistakes=True):
        from m3serve.structured.compiler import compile_grammar

        self.llm, self.mistakes = llm, mistakes
        vocab = llm.engine.worker.runner.vocab_size
        self.vocab = vocab
        self.known = {}                 # prompt -> (prompt + output ids, compiled grammar, prompt length)
        for (prompt, params), outs in zip(requests, want):
            p = params.clone()
            p.add_eos_token_ids([eos])
            self.known[tuple(prompt)] = (prompt + outs[0][0], compile_grammar(p, tiny_dir, vocab), len(prompt))
        self.num_valid_mistakes = self.num_invalid_mistakes = 0

    def _allowed(self, grammar, outputs: list[int]) -> torch.Tensor | None:
        import xgrammar as xgr
        matcher = xgr.GrammarMatcher(grammar)
        for t in outputs:
            if not matcher.accept_token(t):
                return None
        if matcher.is_terminated():
            return None
        bitmask = xgr.allocate_token_bitmask(1, self.vocab)
        matcher.fill_next_token_bitmask(bitmask, 0)
        bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1            # [W, 32]
        return bits.reshape(-1)[:self.vocab].bool()

    def drafts(self, prompt: tuple, last_position: int) -> list[int] | None:
        """The k drafts after the token that follows `last_position`."""
        found = self.known.get(prompt)
        if found is None:
            return None
        seq, grammar, num_prompt = found
        pos = last_position + 2
        toks = (seq[pos:pos + K] + [1] * K)[:K]
        if not self.mistakes or pos + K > len(seq):
            return toks
        if (pos // 3) % 3 == 2:                     # the last draft: another token the grammar allows
            allowed = self._allowed(grammar, seq[num_prompt:pos + K - 1])
            if allowed is not None:
                allowed[seq[pos + K - 1]] = False
                others = allowed.nonzero().flatten()
                if len(others):
                    toks[-1] = int(others[len(others) // 2])
                    self.num_valid_mistakes += 1
        elif (pos // 3) % 3 == 1:                   # the second draft: a token the grammar refuses
            allowed = self._allowed(grammar, seq[num_prompt:pos + 1])
            if allowed is not None and not allowed.all():
                toks[1] = int((~allowed).nonzero().flatten()[0])
                self.num_invalid_mistakes += 1
        return toks

    def install_eager(self):
        runner = self.llm.engine.worker.runner
        proposer, step_fn = runner.proposer, runner._speculative_step
        real, state = proposer.propose, {}

        def speculative_step(so, batch, dp):
            state["rows"] = batch.rows.tolist()
            return step_fn(so, batch, dp)

        def propose(step):
            out = real(step)
            for i, row in enumerate(state["rows"]):
                toks = self.drafts(self._prompt(row), step.last_position_cpu[i])
                if toks is not None:
                    out[i] = torch.tensor(toks)
            return out

        runner._speculative_step, proposer.propose = speculative_step, propose

    def _prompt(self, row: int) -> tuple:
        b = self.llm.engine.worker.runner.batch
        return tuple(b.token_ids[row, :int(b.num_prompt_tokens[row])].tolist())


def _record_emitted(llm) -> list[list[int]]:
    """Every verify step's emitted blocks (of requests that sampled), in order."""
    sampler = llm.engine.worker.runner.step_sampler
    real, blocks = sampler.speculative_output, []

    def output(so, batch, emitted, proposals, done, *rest, **kwargs):
        blocks.extend(e for e, d in zip(emitted, done) if d)
        return real(so, batch, emitted, proposals, done, *rest, **kwargs)

    sampler.speculative_output = output
    return blocks


@pytest.mark.parametrize("kind,oracle", [("eagle3", False), ("eagle3", True), ("mtp", True), ("dspark", True)],
                         ids=["eagle3-own-drafts", "eagle3-oracle-drafts", "mtp-oracle-drafts", "dspark-oracle-drafts"])
def test_greedy_structured_lossless(tiny_dir, drafts, reference, kind, oracle):
    requests, want, eos = reference
    assert all(f == "stop" for i in (0, 1, 3) for _, f in want[i])   # the JSON and regex grammars completed
    target = drafts["dspark"] if kind == "dspark" else tiny_dir      # DSpark: the target's own dspark/ folder
    llm = LLM(str(target), speculative_config=_spec(kind, drafts, K), **_flags(kind))
    if oracle:
        orc = Oracle(llm, requests, want, eos, tiny_dir)
        orc.install_eager()
    blocks = _record_emitted(llm)
    assert _generate(llm, requests) == want
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_drafts > 10
    if oracle:
        assert orc.num_valid_mistakes >= 3 and orc.num_invalid_mistakes >= 3
        assert stats.mean_acceptance_length > 2.0
        # some grammar ended inside an accepted block: its stop token was a kept draft, with
        # the bonus token after it discarded
        assert any(eos in b[:-1] for b in blocks)
    _check_clean(llm)


def test_graph_step_applies_the_masks(tiny_dir, drafts, reference):
    """The speculative graph step (replays run eagerly on CPU) with oracle drafts: the masks
    are filled before the verify replay and applied on the device; outputs equal speculation
    off."""
    from test_spec_graphs_host import EagerReplaySpecGraphs

    requests, want, eos = reference
    llm = LLM(str(tiny_dir), dtype="float32", max_num_seqs=8,
              speculative_config={"method": "eagle3", "model": str(drafts["eagle3"]), "num_speculative_tokens": K})
    runner = llm.engine.worker.runner
    orc = Oracle(llm, requests, want, eos, tiny_dir)
    orc.install_eager()
    state = {}

    class OracleGraphs(EagerReplaySpecGraphs):
        def draft(self, b, q, num_reqs):
            out = super().draft(b, q, num_reqs).clone()
            last = self._outputs[4][self.last_index[:b]].tolist()
            for i, row in enumerate(state["rows"]):
                toks = orc.drafts(orc._prompt(row), last[i])
                if toks is not None:
                    out[i] = torch.tensor(toks)
            return out

    graph_step = runner._speculative_graph_step

    def speculative_graph_step(so, batch, b, q):
        state["rows"] = batch.rows.tolist()
        return graph_step(so, batch, b, q)

    runner._speculative_graph_step = speculative_graph_step
    runner.spec_graphs = OracleGraphs(runner.model, runner.proposer, runner.buffers, [1, 2, 4, 8], K,
                                      runner.max_model_len)
    runner.spec_graphs.capture(runner.batch)
    assert _generate(llm, requests) == want
    assert runner.spec_graphs.replays[K + 1] > 5
    assert llm.engine.core.scheduler.spec_stats.mean_acceptance_length > 2.0
    _check_clean(llm)


def _holds(name: str, text: str) -> bool:
    if name == "json":
        value = json.loads(text)
        return set(value) == {"color", "n"} and value["color"] in ("red", "green", "blue") \
            and isinstance(value["n"], int) and 0 <= value["n"] <= 99
    return re.fullmatch(REGEX, text) is not None


def test_sampled_structured_output_satisfies_the_grammar(tiny_dir, drafts, reference):
    """Seeded sampling (temperature 0.8) with speculation and oracle drafts (high acceptance,
    with drafts the grammar refuses planted): every JSON and regex output completes its grammar."""
    requests, want, eos = reference
    sampled = [(p, SamplingParams(temperature=0.8, seed=7 + i, max_tokens=32, n=2,
                                  structured_outputs=s.structured_outputs))
               for i, (p, s) in enumerate(requests) if i != 2]
    llm = LLM(str(tiny_dir), speculative_config=_spec("eagle3-gqa", drafts, K), **_flags("eagle3-gqa"))
    orc = Oracle(llm, requests, want, eos, tiny_dir)
    orc.install_eager()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in sampled], [s for _, s in sampled], use_tqdm=False)
    for name, o in zip(["json", "regex", "json"], outs):
        for c in o.outputs:
            assert c.finish_reason == "stop" and _holds(name, c.text), (name, c.text)
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_accepted_tokens > 10 and orc.num_invalid_mistakes >= 2
    _check_clean(llm)
