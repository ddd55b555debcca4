"""The speculation gate (core/spec_gate.py): the fixed rule, and the measured one driven by a
fake clock -- a bucket times drafts (once they settle) and plain steps, keeps the kind that
emits more tokens per request per second, logs the change, retries the other now and then,
times only steady decode steps, and falls back to drafts where it cannot time both."""
import logging
from types import SimpleNamespace

import pytest

from m3serve.core import spec_gate as sg
from m3serve.core.spec_gate import SpeculationGate, bucket_of


def _step(on: bool, drafted: bool, rows: int, decode_only: bool = True, padded=()) -> SimpleNamespace:
    """A SchedulerOutput's fields the gate reads: `rows` requests, each with 3 drafts when
    `drafted`, each computing one token (and its drafts), or 10 more with a prompt chunk;
    `padded`: the requests whose drafts are stand-ins."""
    spec = {f"r{i}": [1, 2, 3] for i in range(rows)} if drafted else {}
    extra = 0 if decode_only else 10
    return SimpleNamespace(speculate=on, scheduled_spec_decode_tokens=spec, deferred=False, padded_drafts=set(padded),
                           num_scheduled_tokens={f"r{i}": 1 + len(spec.get(f"r{i}", ())) + extra
                                                 for i in range(rows)})


RETRY = 1 + sg.SETTLE + sg.MIN_SAMPLES     # drafted steps of a retry here: a switch, SETTLE, timed


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _run(gate, clock, steps, running, spec_cost, accept, plain_cost=1.0, decode_only=True, plain_pause=0.0):
    """`steps` steps of `running` requests. A step with drafts takes spec_cost s and emits
    `accept` tokens per request (a list: its drafted steps take them in turn), one without
    takes plain_cost and emits one; after a plain
    step the requests have no drafts, so a step asked to speculate verifies none (a switch).
    `plain_pause`: the loop waits that long before each plain step. Returns the decisions."""
    kinds, had_drafts = [], getattr(gate, "_test_drafts", True)
    cycle = accept if isinstance(accept, list) else [accept]
    for _ in range(steps):
        on = gate.speculate(running)
        drafted = on and had_drafts
        if not on:
            clock.t += plain_pause
        step = _step(on, drafted, running, decode_only)
        gate.scheduled(step)
        clock.t += spec_cost if drafted else plain_cost
        if drafted:
            gate._test_n = getattr(gate, "_test_n", -1) + 1
        gate.observe(step, round(running * (cycle[gate._test_n % len(cycle)] if drafted else 1)))
        kinds.append(on)
        had_drafts = on                  # a step that speculated proposed drafts for the next
    gate._test_drafts = had_drafts
    return kinds


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_fixed_rule_and_always():
    gate = SpeculationGate(fixed=4, measured=True)
    assert gate.rule == "fixed"
    assert [gate.speculate(n) for n in (1, 3, 4, 9, 2)] == [True, True, False, False, True]
    always = SpeculationGate()
    assert always.rule == "always" and all(always.speculate(n) for n in (1, 16, 256))


def test_drafts_that_lose_are_turned_off_and_retried(caplog):
    clock = Clock()
    gate = SpeculationGate(measured=True, clock=clock)
    with caplog.at_level(logging.INFO, logger="m3serve.core.spec_gate"):
        kinds = _run(gate, clock, 4000, running=6, spec_cost=3.0, accept=2.0)   # 0.67 vs 1.0 token/s
    # drafts until 4 are timed (after SETTLE untimed ones), then plain until 4 are timed; then
    # drafts (what a bucket starts with) until OFF_MIN_ROWS requests' verify steps show the loss
    explore = sg.SETTLE + sg.MIN_SAMPLES
    assert kinds[:explore] == [True] * explore
    assert kinds[explore:explore + 1 + sg.MIN_SAMPLES] == [False] * (1 + sg.MIN_SAMPLES)
    timed_before_off = -(-sg.OFF_MIN_ROWS // 6)
    off = explore + 1 + sg.MIN_SAMPLES + 1 + sg.SETTLE + timed_before_off - sg.MIN_SAMPLES
    assert kinds[explore + 1 + sg.MIN_SAMPLES:off] == [True] * (off - explore - 1 - sg.MIN_SAMPLES)
    assert not kinds[off]
    assert "off for 5-8 running requests" in caplog.text and "0.7 tokens/s per request with drafts" in caplog.text
    assert "(2.00 tokens per request every 3000.00 ms), 1.0 without (every 1000.00 ms)" in caplog.text
    later = kinds[off:]
    starts = [i for i in range(1, len(later)) if later[i] and not later[i - 1]]
    assert len(starts) >= 4 and later.count(True) == len(starts) * RETRY
    # each retry that loses doubles the wait before the next one
    waits = [b - a for a, b in zip([0] + starts, starts)]
    assert [round(w / waits[0]) for w in waits[:4]] == [1, 2, 4, 8] and waits[0] >= sg.DRAFT_PROBE_EVERY
    assert caplog.text.count("speculative decoding") == 1      # the retries do not flip it
    assert len(gate.buckets[8].rates[True]) == sg.MIN_SAMPLES     # each retry timed drafts anew


def test_drafts_that_win_stay_on_and_a_change_of_acceptance_flips_them(caplog):
    clock = Clock()
    gate = SpeculationGate(measured=True, clock=clock)
    kinds = _run(gate, clock, 1200, running=16, spec_cost=2.0, accept=2.8)      # 1.4 vs 1.0
    assert kinds.count(False) == 1 + sg.MIN_SAMPLES + sg.PLAIN_PROBE_STEPS   # exploring, one retry
    with caplog.at_level(logging.INFO, logger="m3serve.core.spec_gate"):
        kinds = _run(gate, clock, 300, running=16, spec_cost=2.0, accept=1.5)   # 0.75 vs 1.0
    assert "off for 9-16 running requests" in caplog.text
    assert kinds[-100:].count(True) <= RETRY
    # another bucket has its own books: it explores from the start
    assert _run(gate, clock, 3, running=2, spec_cost=2.0, accept=1.5) == [True] * 3


def test_near_equal_rates_keep_what_runs(caplog):
    """A bucket starts with drafts: drafts 2 % slower than plain steps stay on (every change
    costs steps no sample sees), 10 % slower go off; once off, drafts 2 % faster do not turn
    them on again, 10 % faster do."""
    clock = Clock()
    gate = SpeculationGate(measured=True, clock=clock)
    kinds = _run(gate, clock, 300, running=4, spec_cost=2.0, accept=1.96)      # 0.98 vs 1.0
    assert gate.buckets[4].choice is True and kinds[50:].count(False) <= sg.PLAIN_PROBE_STEPS
    _run(gate, clock, 300, running=4, spec_cost=2.0, accept=1.8)               # 0.9 vs 1.0
    assert gate.buckets[4].choice is False
    with caplog.at_level(logging.INFO, logger="m3serve.core.spec_gate"):
        _run(gate, clock, 2500, running=4, spec_cost=2.0, accept=2.04)         # 1.02 vs 1.0
    assert gate.buckets[4].choice is False and "decoding on" not in caplog.text
    _run(gate, clock, 2500, running=4, spec_cost=2.0, accept=2.2)              # 1.1 vs 1.0
    assert gate.buckets[4].choice is True


def test_a_bucket_that_cannot_time_plain_steps_speculates():
    clock = Clock()
    gate = SpeculationGate(measured=True, clock=clock)
    kinds = _run(gate, clock, 600, running=4, spec_cost=2.0, accept=1.2, plain_pause=1.0)
    explore = sg.SETTLE + sg.MIN_SAMPLES
    assert kinds[:explore] == [True] * explore
    assert kinds[explore:sg.EXPLORE_LIMIT] == [False] * (sg.EXPLORE_LIMIT - explore)
    assert kinds[sg.EXPLORE_LIMIT:] == [True] * (600 - sg.EXPLORE_LIMIT)


@pytest.mark.parametrize("case", ["prefill", "switch", "stand-ins", "pause"])
def test_only_steady_decode_steps_are_timed(case):
    clock = Clock()
    gate = SpeculationGate(measured=True, clock=clock)
    if case == "prefill":           # steps with prompt chunks
        _run(gate, clock, 20, running=4, spec_cost=3.0, accept=2.0, decode_only=False)
        assert not gate.buckets[4].rates[True]
        return
    for i in range(20):
        if case == "switch":        # drafts asked for, none to verify yet: not a drafted step
            step = _step(True, False, 4)
        elif case == "stand-ins":   # ... or stand-ins for some requests (the scheduler's padding)
            step = _step(True, True, 4, padded={"r1"})
        else:                       # the loop waited between an output and the next step
            step = _step(True, True, 4)
            clock.t += 1.0
        gate.scheduled(step)
        clock.t += 2.0
        gate.observe(step, 8)
    assert not gate.buckets.get(4) or not gate.buckets[4].rates[True]


def test_a_step_that_may_compute_prompt_tokens_speculates_and_who_measures():
    from m3serve.core.spec_gate import measured_rule_applies
    clock = Clock()
    gate = SpeculationGate(measured=True, clock=clock)
    _run(gate, clock, 40, running=6, spec_cost=3.0, accept=2.0)          # plain chosen for 5-8
    assert gate.speculate(6, lambda: False) is False and gate.speculate(6, lambda: True) is True

    def config(dp=1, limit=None, method="eagle3"):
        return SimpleNamespace(speculative=SimpleNamespace(enabled=method is not None, disable_by_batch_size=limit),
                               parallel=SimpleNamespace(data_parallel_size=dp))
    assert measured_rule_applies(config(), "cuda")
    assert not any([measured_rule_applies(config(), "cpu"), measured_rule_applies(config(dp=2), "cuda"),
                    measured_rule_applies(config(limit=4), "cuda"), measured_rule_applies(config(method=None), "cuda")])


def test_drafts_are_rated_by_the_tokens_they_emit_on_average():
    """A verify step emits 1 to k + 1 tokens per request: here most drafted steps keep no draft
    and every third keeps 6, 3 tokens per 2 s on average (1.5 tokens/s) against 1 token/s
    plain. Rating each step alone and taking the median would see 0.5 tokens/s and turn the
    drafts off; the gate keeps them on."""
    clock = Clock()
    gate = SpeculationGate(measured=True, clock=clock)
    kinds = _run(gate, clock, 400, running=1, spec_cost=2.0, accept=[1, 1, 7])
    assert gate.buckets[1].choice is True
    assert gate.buckets[1].rate(True) == pytest.approx(1.5, rel=0.2)
    assert gate.buckets[1].rate(False) == pytest.approx(1.0)
    assert kinds[-300:].count(False) <= sg.PLAIN_PROBE_STEPS


def _synthetic_accepts(seed: int, steps: int, mean: float = 2.3, k: int = 7) -> list[int]:
    """Tokens a verify step emits per request when each of k drafts is kept, once the one
    before it was, with the synthetic rule's probability for `mean` (1 to k + 1 a step)."""
    import random

    from m3serve.spec.rejection import synthetic_acceptance_rate
    alpha, rng = synthetic_acceptance_rate(mean, k), random.Random(seed)
    out = []
    for _ in range(steps):
        kept = 0
        while kept < k and rng.random() < alpha:
            kept += 1
        out.append(1 + kept)
    return out


def test_noisy_acceptance_does_not_turn_winning_drafts_off():
    """One request, k = 7 drafts kept as a synthetic run keeps them (mean 2.3 tokens a step,
    1 to 8 from step to step) at 2x a plain step's cost: drafts win by 15 %. The mean of a few
    steps, checked at every step, dips below the plain rate again and again; averaged over
    ACCEPT_ROWS verify steps, and turned off only on a significant loss, drafts stay on -- in
    each of 20 runs."""
    for seed in range(20):
        clock = Clock()
        gate = SpeculationGate(measured=True, clock=clock)
        kinds = _run(gate, clock, 3000, running=1, spec_cost=2.0, accept=_synthetic_accepts(seed, 3000))
        assert gate.buckets[1].choice is True, seed
        assert kinds[100:].count(False) <= 3 * sg.PLAIN_PROBE_STEPS, seed    # only the retries of plain steps


def test_noisy_acceptance_turns_losing_drafts_off():
    """The same spread at 2.54x a plain step's cost at 4 requests: drafts lose by 9 %. Each of
    20 runs turns them off, and drafts run in under 15 % of the steps, retries included."""
    drafted = 0
    for seed in range(20):
        clock = Clock()
        gate = SpeculationGate(measured=True, clock=clock)
        kinds = _run(gate, clock, 3000, running=4, spec_cost=2.54, accept=_synthetic_accepts(seed, 3000))
        assert False in kinds, seed
        drafted += kinds.count(True)
    assert drafted < 0.15 * 20 * 3000


def test_one_slow_step_does_not_decide():
    """The period is the median of the timed steps': one step slowed 50x (a collection, another
    process) among drafted steps that win 2 : 1 leaves the choice as it was."""
    clock = Clock()
    gate = SpeculationGate(measured=True, clock=clock)
    _run(gate, clock, 40, running=2, spec_cost=1.0, accept=2.0)
    assert gate.buckets[2].choice is True
    gate.buckets[2].rates[True].append((2.0, 50.0))
    _run(gate, clock, 5, running=2, spec_cost=1.0, accept=2.0)
    assert gate.buckets[2].choice is True and gate.buckets[2].rate(True) == pytest.approx(2.0)


def test_deferred_plain_steps_are_timed(monkeypatch):
    """Async scheduling: a plain step's output comes back after the next step was scheduled
    and launched. Each step keeps its own schedule time, so such steps are still timed, at the
    loop's period between outputs -- except the one whose output a landing step brings (it
    launches nothing, so that period is short) -- and the bucket compares them with drafts."""
    monkeypatch.setattr(sg, "SAMPLES", 10_000)                          # keep every timed step
    clock = Clock()
    gate = SpeculationGate(measured=True, clock=clock)
    pending, had_drafts = None, True    # the deferred plain step whose output comes next
    landings = 0
    for _ in range(1000):               # past retries of drafts, each after a landing step
        on = gate.speculate(4)
        if on and pending is not None:  # drafts wait for the deferred output: a landing step
            landing = SimpleNamespace(speculate=False, scheduled_spec_decode_tokens={},
                                      num_scheduled_tokens={}, deferred=False, padded_drafts=set())
            gate.scheduled(landing)
            clock.t += 0.1
            gate.observe(pending, 4)
            gate.observe(landing, 0)
            pending, landings = None, landings + 1
            continue
        step = _step(on, on and had_drafts, 4)
        step.deferred = not on
        gate.scheduled(step)
        clock.t += 3.0 if step.scheduled_spec_decode_tokens else 1.0
        if pending is not None:         # this step's launch lands the previous one's output
            gate.observe(pending, 4)
            pending = None
        if on:
            gate.observe(step, 6 if step.scheduled_spec_decode_tokens else 4)
        else:
            pending = step
        had_drafts = on
    bucket = gate.buckets[4]
    assert landings >= 2
    assert len(bucket.rates[False]) >= sg.MIN_SAMPLES                  # deferred plain steps timed
    assert all(period == pytest.approx(1.0) for _, period in bucket.rates[False])
    assert bucket.choice is False                                       # 1.5 / 3 s < 1 / 1 s
