"""Speculative decoding end to end on the tiny model: greedy outputs equal speculation-off
outputs token for token with EAGLE3 (MHA and GQA) and MTP (standalone and bundled), over a
batch with chunked prefill, preemption, a prefix hit, a stop string, max_tokens and n = 2 --
with the random drafts (almost every draft rejected) and with an oracle that proposes the true
continuation with planted mistakes (long accepted runs, so stops and max_tokens land inside
them). Every run ends with the KV pool whole."""
import pytest
import torch

from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams

LENS = (5, 37, 80, 150, 9, 120)
EXTRA_KV = {"eagle3": 1024, "eagle3-gqa": 256, "mtp": 1280, "bundled": 1280,   # draft bytes/token (fp32)
            "dspark": 1024}


def _prompts():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 2000, (40,), generator=g).tolist()
    out = [torch.randint(0, 2000, (n,), generator=g).tolist() for n in LENS]
    return out + [shared, shared + [7, 8, 9, 10, 11, 12]]       # the last one hits the prefix cache


def _spec(kind, drafts, k=3) -> dict:
    if kind == "bundled":
        return {"method": "mtp", "num_speculative_tokens": k}
    if kind == "dspark":                          # the target's own dspark/ folder
        return {"method": "dspark", "num_speculative_tokens": k}
    return {"method": "mtp" if kind == "mtp" else "eagle3", "model": str(drafts[kind]), "num_speculative_tokens": k}


def _flags(kind=None, blocks=20):
    extra = EXTRA_KV[kind] if kind else 0
    return dict(dtype="float32", max_num_batched_tokens=40, max_num_seqs=8,
                kv_cache_memory=blocks * 16 * (2944 + extra))


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], [[c.text for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm = LLM(str(tiny_dir), **_flags())
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2)
    ids, texts = _generate(llm, prompts, greedy)
    return prompts, ids, texts


def _oracle(llm, continuations: dict[tuple, list[int]], k: int):
    """Make the proposer's proposals the true continuation, with every third draft wrong."""
    runner = llm.engine.worker.runner
    proposer, step_fn = runner.proposer, runner._speculative_step
    real = proposer.propose
    state = {}

    def speculative_step(so, batch, dp):
        state["rows"] = batch.rows.tolist()
        return step_fn(so, batch, dp)

    def propose(step):
        out = real(step)
        b = runner.batch
        for i, row in enumerate(state["rows"]):
            seq = continuations.get(tuple(b.token_ids[row, :int(b.num_prompt_tokens[row])].tolist()))
            if seq is None:
                continue
            pos = step.last_position_cpu[i] + 2
            toks = (seq[pos:pos + k] + [1] * k)[:k]
            if (pos // 3) % 3 == 2:
                toks[-1] = (toks[-1] + 1) % 2048
            out[i] = torch.tensor(toks)
        return out

    runner._speculative_step, proposer.propose = speculative_step, propose


def _check_clean(llm):
    core = llm.engine.core
    assert not core.scheduler.has_unfinished_requests()
    core.scheduler.check_integrity()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_usable_blocks
    draft = core.kv_manager.draft                 # DSpark's window pool
    assert draft is None or draft.num_free_blocks == draft.pool.num_usable_blocks


@pytest.mark.parametrize("kind", ["eagle3", "eagle3-gqa", "mtp", "bundled", "dspark"])
@pytest.mark.parametrize("oracle", [False, True], ids=["own-drafts", "oracle-drafts"])
def test_greedy_lossless(tiny_dir, drafts, reference, kind, oracle):
    prompts, want_ids, want_texts = reference
    target = drafts[kind] if kind in ("bundled", "dspark") else tiny_dir
    llm = LLM(str(target), speculative_config=_spec(kind, drafts), **_flags(kind))
    if oracle:
        _oracle(llm, {tuple(p): p + ids[0] for p, ids in zip(prompts, want_ids)}, 3)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2)
    got_ids, _ = _generate(llm, prompts, greedy)
    assert got_ids == want_ids
    # a stop string from the middle of an answer cuts the output where plain decoding cuts it
    stop = want_texts[3][0][len(want_texts[3][0]) // 2:][:4]
    stopped = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    plain = LLM(str(tiny_dir), **_flags()) if stop.strip() else None
    if plain is not None:
        assert _generate(llm, prompts[3:4], stopped) == _generate(plain, prompts[3:4], stopped)
    sched = llm.engine.core.scheduler
    assert sched.spec_stats.num_drafts > 0 and sched.num_preemptions > 0
    assert llm.engine.core.kv_manager.prefix_cache_hits >= 32
    if oracle:
        assert sched.spec_stats.mean_acceptance_length > 2.0
    _check_clean(llm)


def test_logit_bias_verifies_no_drafts_and_one_metadata_per_step(tiny_dir, drafts):
    """A request with logit_bias gets no drafts (rejection sampling would verify them without
    the bias): its tokens equal speculation off, beside seeded sampled requests that verify
    drafts in the same steps. Each step builds its sampling metadata once, also when it
    samples plain rows and verifies drafted ones together."""
    from m3serve.worker.sampler import SamplingMetadata

    prompts = _prompts()[:4]
    biased = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={42: 30.0, 77: 29.0})
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    plain = LLM(str(tiny_dir), **_flags())
    want, _ = _generate(plain, prompts[:1], biased)

    llm = LLM(str(tiny_dir), speculative_config=_spec("eagle3-gqa", drafts), **_flags("eagle3-gqa"))
    runner = llm.engine.worker.runner
    steps, counts = [], {"metadata": 0, "plain": 0, "verify": 0}
    real_execute, real_build = runner.execute_model, SamplingMetadata.from_params.__func__
    rejection, sampler = runner.step_sampler.rejection, runner.step_sampler.sampler
    real_sample = sampler.forward

    class CountingRejection:
        method = rejection.method

        def __call__(self, *args):
            counts["verify"] += 1
            return rejection(*args)

    def build(cls, *args, **kwargs):
        counts["metadata"] += 1
        return real_build(cls, *args, **kwargs)

    def execute(so, *args):
        for key in counts:
            counts[key] = 0
        out = real_execute(so, *args)
        steps.append(dict(counts))
        return out

    def sample(*args):
        counts["plain"] += 1
        return real_sample(*args)

    runner.step_sampler.rejection = CountingRejection()
    runner.execute_model, sampler.forward = execute, sample
    SamplingMetadata.from_params = classmethod(build)
    try:
        got, _ = _generate(llm, prompts, [biased] + [sampled] * 3)
    finally:
        SamplingMetadata.from_params = classmethod(real_build)
    assert got[:1] == want
    assert llm.engine.core.scheduler.spec_stats.num_drafts > 0
    assert any(s["plain"] and s["verify"] for s in steps)          # mixed steps happened
    assert max(s["metadata"] for s in steps) == 1
    _check_clean(llm)


def test_in_process_state_reports_speculation(tiny_dir, drafts):
    """`engine_states()` of the in-process engine is built where the engine process builds
    its answer, so it carries the speculation counters too."""
    llm = LLM(str(tiny_dir), speculative_config=_spec("eagle3-gqa", drafts), **_flags("eagle3-gqa"))
    _generate(llm, _prompts()[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    stats, state = llm.engine.core.scheduler.spec_stats, llm.engine.engine_states()[0]
    assert state.spec_num_drafts == stats.num_drafts > 0
    assert state.spec_num_draft_tokens == stats.num_draft_tokens > 0
    assert state.spec_num_accepted_tokens == stats.num_accepted_tokens
    assert state.num_free_blocks == state.num_usable_blocks and state.integrity_error is None


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_disable_by_batch_size_decodes_big_batches_without_drafts(tiny_dir, drafts, kind):
    """With disable_by_batch_size 3, steps of 3+ running requests decode plainly (no drafts, no
    draft pass; deferred, as async scheduling is on) and smaller ones speculate again as
    requests finish, each time after a step that lands the last deferred tokens; greedy outputs
    equal speculation off, and the books balance."""
    prompts = _prompts()[:6]
    lens = [4, 6, 9, 14, 20, 28]                     # the batch shrinks as the short ones finish
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    plain = LLM(str(tiny_dir), **_flags())
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    spec = {**_spec(kind, drafts), "disable_by_batch_size": 3}
    llm = LLM(str(drafts[kind] if kind == "dspark" else tiny_dir), speculative_config=spec, **_flags(kind))
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == want
    sched = llm.engine.core.scheduler
    assert sched.num_plain_steps > 3 and sched.spec_stats.num_drafts > 3
    assert sched.num_deferred_steps > 3 and sched.num_landing_steps > 0
    _check_clean(llm)


def test_measured_gate_turns_losing_drafts_off(tiny_dir, drafts, caplog):
    """The GPU default (core/spec_gate.py) driven by a fake clock under which a step with drafts
    costs 3x a plain one: the tiny random drafts (almost all rejected) lose, the engine turns
    them off for the batch and says so, greedy outputs still equal speculation off, and the
    books balance (DSpark: switching leaves holes in its window cache)."""
    from m3serve.core.spec_gate import SpeculationGate
    kind = "dspark"
    prompts = [p[:8] for p in _prompts()[1:5]]        # admitted together: 4 running throughout
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = LLM(str(tiny_dir), **_flags())
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    llm = LLM(str(drafts[kind] if kind == "dspark" else tiny_dir), speculative_config=_spec(kind, drafts),
              **_flags(kind))
    core, now = llm.engine.core, [0.0]
    sched, execute = core.scheduler, core.executor.execute_model
    assert sched.spec_gate.rule == "always"              # a CPU engine
    sched.spec_gate = SpeculationGate(sched.num_lookahead_tokens, measured=True, clock=lambda: now[0])

    def timed(step):
        now[0] += 3.0 if step.scheduled_spec_decode_tokens else 1.0
        return execute(step)
    core.executor.execute_model = timed
    with caplog.at_level("INFO", logger="m3serve.core.spec_gate"):
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]
    assert got == want
    assert "speculative decoding off for 3-4 running requests" in caplog.text
    assert sched.num_plain_steps > 15 and sched.spec_stats.num_drafts > 3
    _check_clean(llm)


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_fewer_drafts_per_batch_keep_greedy_output(tiny_dir, drafts, kind):
    """The measured gate, under a fake clock where verifying one draft costs little and more
    cost much, with drafts that are the true continuation (long accepted runs): the bucket of
    3-4 requests verifies every width of drafts in turn (4, 3, 1) and plain steps, then only
    the first of each request's 4 drafts (the KV pool holds 3 of the 4 requests at once: the
    fourth waits, preempted, without making every step run the draft pass); greedy outputs
    equal speculation off token for token, and the books balance."""
    from m3serve.core.spec_gate import MIN_SAMPLES, SpeculationGate, draft_widths
    k = 4
    prompts = [p[:8] for p in _prompts()[1:5]]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = LLM(str(tiny_dir), **_flags())
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    llm = LLM(str(drafts[kind] if kind == "dspark" else tiny_dir), speculative_config=_spec(kind, drafts, k),
              **_flags(kind))
    _oracle(llm, {tuple(p): p + w for p, w in zip(prompts, want)}, k)
    core, now, widths = llm.engine.core, [0.0], []
    sched, execute = core.scheduler, core.executor.execute_model
    sched.spec_gate = SpeculationGate(k, measured=True, clock=lambda: now[0])

    def timed(step):
        verified = {len(d) for d in step.scheduled_spec_decode_tokens.values()}
        widths.append(max(verified, default=0))
        now[0] += 1.0 + (0.1 if max(verified, default=0) <= 1 else 5.0)
        return execute(step)
    core.executor.execute_model = timed
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == want
    assert set(draft_widths(k)) <= set(widths)                    # every width verified while exploring
    print("WIDTHS", widths)
    assert sched.spec_gate.buckets[4].choice == 1 and widths.count(1) >= 4 + 2  # then one draft a request
    assert sched.num_preemptions > 0 and sched.num_plain_steps >= 1 + MIN_SAMPLES
    _check_clean(llm)


def test_logprobs_and_prompt_logprobs_with_speculation(tiny_dir, drafts):
    """A request asking for logprobs (or prompt logprobs) verifies no drafts, and gets the same
    logprobs and prompt logprobs as without speculation, beside requests that speculate."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:3]]
    asks = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    plain_params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    params = [asks, plain_params, asks]

    def run(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]
    want = run(LLM(str(tiny_dir), **_flags()))
    got = run(LLM(str(tiny_dir), speculative_config=_spec("eagle3", drafts), **_flags("eagle3")))
    assert want[0][1] and want[0][2] and len(want[0][1]) == 6
    assert got == want


def test_mtp_layers_report_after_the_targets(tiny_dir, drafts):
    """The MTP modules' layers report to layers/probes.py as num_hidden_layers + m, so a probe
    (the bench's measured-experts count) never mixes draft and target layers."""
    from m3serve.layers import probes

    llm = LLM(str(tiny_dir), speculative_config=_spec("mtp", drafts, k=2), **_flags("mtp"))
    with probes.installed(probes.Recorder()) as rec:
        _generate(llm, _prompts()[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    cfg = llm.engine.model_config
    L = cfg.num_hidden_layers
    modules = len(llm.engine.worker.runner.proposer.drafter.draft.modules_)
    target_moe = {i for i in range(L) if cfg.is_moe(i)}
    draft = set(range(L, L + modules))
    assert set(rec.latest(probes.ROUTED_EXPERTS)) == target_moe | draft
    assert set(rec.latest(probes.SPARSE_BLOCKS)) == set(cfg.sparse_layer_ids) | draft


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_fp8_kv_keeps_the_draft_cache_in_the_model_dtype(tiny_dir, drafts, kind):
    """With --kv-cache-dtype fp8 the target's cache is fp8 but a draft's stays in the model dtype
    (it has no cache scales; the GPU kernel refuses an fp8 cache without them), and greedy
    outputs stay equal to speculation off with the same fp8 target cache."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:3]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(str(tiny_dir), dtype="float32", kv_cache_dtype="fp8")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(str(drafts[kind] if kind == "dspark" else tiny_dir), dtype="float32", kv_cache_dtype="fp8",
              speculative_config=_spec(kind, drafts))
    drafter = llm.engine.worker.runner.proposer.drafter
    caches = drafter.draft.kv_caches if kind == "dspark" else [drafter.draft.kv_cache]
    assert all(c.dtype == torch.float32 for c in caches)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want


class _ScriptedGate:
    """A speculation gate of k drafts whose answers come from `width(k, num_running, prompt_due,
    joining)`; it times nothing."""
    rule = "scripted"

    def __init__(self, k, width):
        self.k, self._width = k, width

    def draft_width(self, num_running, prompt_due=lambda: False, length=lambda: None, joining=None):
        return self._width(self.k, num_running, prompt_due, joining)

    def scheduled(self, step):
        pass

    def observe(self, step, num_requests=None, verified=()):
        pass


def _scripted_run(tiny_dir, drafts, kind, width, scheduled=None):
    """Six prompts, 24 greedy tokens each, under a `_ScriptedGate` of `width` (and `scheduled(so)`
    on each step the scheduler builds): (the engine, its outputs, speculation off's, the draft
    proposer's calls of `propose` and `write_only`)."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:6]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_dir), **_flags()).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(drafts[kind] if kind == "dspark" else tiny_dir), speculative_config=_spec(kind, drafts),
              **_flags(kind))
    sched, proposer = llm.engine.core.scheduler, llm.engine.worker.runner.proposer
    sched.spec_gate = _ScriptedGate(sched.num_lookahead_tokens, width)
    if scheduled is not None:
        schedule = sched.schedule

        def observed():
            so = schedule()
            scheduled(so)
            return so
        sched.schedule = observed
    calls = dict.fromkeys(("propose", "write_only"), 0)
    for name in calls:
        real = getattr(proposer, name)
        setattr(proposer, name, lambda *a, _real=real, _name=name: calls.__setitem__(_name, calls[_name] + 1)
                or _real(*a))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return llm, got, want, calls


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_prompts_that_join_plain_steps_skip_the_draft_then_drafts_read_holes(tiny_dir, drafts, kind):
    """The gate is asked with the batch the prompts will decode in (`joining`: the running
    requests plus the waiting ones, max_num_seqs at most), and where that batch runs plain steps
    it answers None for prompt steps too: no draft pass over the prompts. When drafts come back
    the draft's KV holds nothing of those prompts (holes below `valid_from`); the greedy outputs
    still equal speculation off."""
    seen = []

    def plain_while_prompts_then_drafts(k, num_running, prompt_due, joining):
        seen.append((num_running, joining()))
        return None if prompt_due() else k
    llm, got, want, calls = _scripted_run(tiny_dir, drafts, kind, plain_while_prompts_then_drafts)
    sched = llm.engine.core.scheduler
    assert got == want
    assert seen[0] == (0, 6)                                # all six wait at the first step
    assert all(running <= joining <= 8 for running, joining in seen)
    assert calls["write_only"] == 0 and calls["propose"] > 0 and sched.spec_stats.num_drafts > 0
    _check_clean(llm)


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_prompt_steps_under_plain_arms_write_draft_kv_without_proposing(tiny_dir, drafts, kind):
    """A gate whose arm is plain steps answers 0 where prompt tokens are due: such a step runs
    the draft over its tokens (the draft's KV) but proposes nothing (`SchedulerOutput.propose`,
    the next plain step would drop the proposals). Such a step is a plain step to the ranks:
    under async scheduling it follows a deferred step without a landing step and is deferred
    itself, its draft pass reading the sampled ids on the device. Later the gate drafts again:
    the requests start from switch steps, and the greedy outputs equal speculation off
    throughout."""
    steps, write_only = [0], []

    def plain_then_drafts(k, num_running, prompt_due, joining):
        """Plain steps (0 where a prompt is due) for the first 30 steps, then k drafts."""
        steps[0] += 1
        if steps[0] > 30:
            return k
        return 0 if prompt_due() else None

    def scheduled(so):
        if so.speculate and not so.propose and so.num_scheduled_tokens:
            write_only.append(so.deferred)
    llm, got, want, calls = _scripted_run(tiny_dir, drafts, kind, plain_then_drafts, scheduled)
    sched = llm.engine.core.scheduler
    assert got == want
    assert calls["write_only"] > 0 and calls["propose"] > 0 and sched.spec_stats.num_drafts > 0
    assert sched.async_scheduling and any(write_only)                # deferred write-only steps
    assert sched.num_landing_steps <= 1                              # only at the switch to drafts
    _check_clean(llm)
