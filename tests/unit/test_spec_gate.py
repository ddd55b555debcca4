"""The speculation gate (core/spec_gate.py): the fixed rule, and the measured one driven by a
fake clock -- a bucket times each width of drafts and plain steps, rates drafts by the
engine's acceptance per draft position, runs the arm that emits the most tokens per request
per second (plain steps only where drafts lose beyond the acceptance's spread, drafts only
where they win by a margin), logs each change with its parts, re-times the other arms now and
then, times only steady decode steps, and falls back to drafts where it cannot time them all.

Step costs in the issue-49 tests are the measurements of one TP 8 rank at full depth (H100,
online fp8 target, 8K prompts): plain steps 5.71 / 7.34 / 13.17 ms at batch 1 / 4 / 16; a
verify of all k drafts costs the measured peer TPOT x the acceptance (EAGLE3-GQA k 3 at 2.78:
3.44 / 5.58 / 9.76 ms per token; DSpark k 7 at 2.3: 4.30 / 9.42 / 14.20). Verifying j < k
drafts is not in the table: its extra cost over a plain step is taken as the full verify's
times sqrt(j / k) (fewer rows, but the experts they touch do not fall in proportion)."""
import logging
import random
from types import SimpleNamespace

import pytest

from m3serve.core import spec_gate as sg
from m3serve.core.spec_gate import Acceptance, SpeculationGate, bucket_of, draft_widths
from m3serve.worker.rejection import synthetic_acceptance_rate

PLAIN_MS = {1: 5.71, 4: 7.34, 16: 13.17}
TABLE = {"eagle3": (3, 2.78, {1: 3.44, 4: 5.58, 16: 9.76}),     # k, acceptance, peer TPOT ms
         "dspark": (7, 2.3, {1: 4.30, 4: 9.42, 16: 14.20})}


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Engine:
    """A synthetic engine of `running` requests: a plain step costs `plain` s, a verify of j
    drafts `verify[j]` s (a switch, verifying none, `verify.get(0, plain)`); each draft is kept
    with probability `alpha` once the one before it was (the synthetic rule). After a plain step
    the requests have no drafts, so the next step that speculates verifies none."""

    def __init__(self, k: int, plain: float, verify: dict, alpha: float, seed: int = 0):
        self.k, self.plain, self.verify, self.alpha = k, plain, verify, alpha
        self.rng = random.Random(seed)
        self.has_drafts = True          # the requests come from prompt steps, which drafted

    @classmethod
    def from_table(cls, kind: str, batch: int, seed: int = 0):
        k, mean, tpot = TABLE[kind]
        plain, full = PLAIN_MS[batch] / 1e3, tpot[batch] * mean / 1e3
        verify = {j: plain + (full - plain) * (j / k) ** 0.5 for j in range(1, k + 1)}
        return cls(k, plain, verify, synthetic_acceptance_rate(mean, k), seed)

    def kept(self, width: int) -> int:
        n = 0
        while n < width and self.rng.random() < self.alpha:
            n += 1
        return n


def _step(width, rows: int, decode_only: bool = True, deferred: bool = False) -> SimpleNamespace:
    """A SchedulerOutput's fields the gate reads: `rows` requests each verifying `width` drafts
    (None: a plain step), each computing one token and its drafts, or 10 more with a prompt chunk."""
    spec = {f"r{i}": [1] * width for i in range(rows)} if width else {}
    extra = 0 if decode_only else 10
    return SimpleNamespace(speculate=width is not None, scheduled_spec_decode_tokens=spec, deferred=deferred,
                           num_scheduled_tokens={f"r{i}": 1 + len(spec.get(f"r{i}", ())) + extra
                                                 for i in range(rows)})


def _run(gate, clock, engine, steps, running, decode_only=True, plain_pause=0.0, length=None):
    """`steps` steps of `running` requests (of `length` output tokens each, None: not said);
    returns the widths the gate gave (None: plain)."""
    widths = []
    for _ in range(steps):
        width = gate.draft_width(running, length=lambda: length)
        verified = None if width is None else width if engine.has_drafts else 0
        if width is None:
            clock.t += plain_pause
        step = _step(verified, running, decode_only)
        gate.scheduled(step)
        clock.t += engine.plain if verified is None else engine.verify.get(verified, engine.plain)
        kept = [engine.kept(verified) for _ in range(running)] if verified else []
        gate.observe(step, verified=[(verified, n) for n in kept])
        widths.append(width)
        engine.has_drafts = width is not None
    return widths


def test_widths_and_buckets():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]
    assert draft_widths(7) == [7, 3, 1] and draft_widths(3) == [3, 1] and draft_widths(1) == [1]
    assert draft_widths(4) == [4, 3, 1] and draft_widths(16) == [16, 15, 7, 3, 1]


def test_fixed_rule_and_always():
    gate = SpeculationGate(3, fixed=4, measured=True)
    assert gate.rule == "fixed"
    assert [gate.draft_width(n) for n in (1, 3, 4, 9, 2)] == [3, 3, None, None, 3]
    always = SpeculationGate(3)
    assert always.rule == "always" and all(always.draft_width(n) == 3 for n in (1, 16, 256))


@pytest.mark.parametrize("mean", [1.3, 2.3, 4.5])
def test_acceptance_predicts_every_width_from_any_widths(mean):
    """E[T_j] of each width from verify steps of mixed widths (k, 3, 1 in turn) equals the
    synthetic rule's 1 + alpha + ... + alpha^j, within 4 standard errors, and the error falls
    as verify steps add up."""
    k, rng = 7, random.Random(1)
    alpha = synthetic_acceptance_rate(mean, k)
    acc = Acceptance(k, rows=100_000)
    errors = []
    for step in range(3000):
        width = (7, 3, 1)[step % 3]
        kept = 0
        while kept < width and rng.random() < alpha:
            kept += 1
        acc.add(width, kept)
        if step in (99, 2999):
            errors.append(acc.error(7))
    for j in (1, 3, 7):
        assert acc.mean(j) == pytest.approx(sum(alpha ** i for i in range(j + 1)), abs=4 * acc.error(j))
    assert errors[1] < errors[0] / 4
    nothing = Acceptance(k)
    for _ in range(16):
        nothing.add(7, 0)
    assert nothing.mean(7) == 1.0 and nothing.error(7) > 0.05    # a few rejections claim no certainty


@pytest.mark.parametrize("seed", range(10))
def test_issue_49_dspark_at_batch_4_goes_plain_within_the_window(seed, caplog):
    """DSpark k 7 at 2.3 at 4 requests, drafted steps slower per token than plain steps (9.42
    against 7.34 ms, as measured; the narrower widths lose too): a fresh bucket (and a fresh
    engine: no acceptance yet) chooses plain steps within the documented window, logs it with
    its parts, and then drafts only in its rare retries."""
    clock, engine = Clock(), Engine.from_table("dspark", 4, seed)
    gate = SpeculationGate(7, measured=True, clock=clock)
    window = (1 + sg.MIN_SAMPLES) * len(draft_widths(7)) + 1 + sg.MIN_SAMPLES   # no deferred steps here
    decide_rows = -(-sg.DECIDE_ROWS // 4)          # ... or, if the loss is not clear by then
    with caplog.at_level(logging.INFO, logger="m3serve.core.spec_gate"):
        widths = _run(gate, clock, engine, 600, running=4)
    assert widths[:window] == [7] * 4 + [3] * 4 + [1] * 4 + [None] * 4      # each arm timed in turn
    # plain steps from there on (or, were the loss not clear yet, after a few more drafted steps)
    settled = window if widths[window] is None else window + 3 + sg.SETTLE + decide_rows
    assert gate.buckets[4].choice == 0
    assert widths[settled:settled + 150] == [None] * 150
    assert "speculative decoding off for 3-4 running requests" in caplog.text
    assert "plain 136.2 (every 7.34 ms); 7 of 7 drafts" in caplog.text and "21.67 ms" in caplog.text
    assert sum(w is not None for w in widths[settled:]) < 0.1 * 600      # the retries


def test_issue_49_table_under_one_engine(caplog):
    """The bench's order, batch 1 then 4 then 16, on one engine (the acceptance is shared):
    EAGLE3 drafts win at every batch and stay on at all 3 (never plain after exploring, but
    for the rare re-timings); DSpark drafts win at 1 and stay on there, and at 4 the bucket
    goes plain as soon as it has timed every arm (the acceptance is known from batch 1)."""
    for kind in ("eagle3", "dspark"):
        clock = Clock()
        gate = SpeculationGate(TABLE[kind][0], measured=True, clock=clock)
        plain_after = {}
        for batch in (1, 4, 16):
            engine = Engine.from_table(kind, batch, seed=batch)
            widths = _run(gate, clock, engine, 400, running=batch)
            explore = (1 + sg.MIN_SAMPLES) * len(draft_widths(engine.k)) + 1 + sg.MIN_SAMPLES
            plain_after[batch] = sum(w is None for w in widths[explore + 1:])
            if kind == "eagle3" or batch == 1:
                assert gate.buckets[batch].choice, (kind, batch)
                assert plain_after[batch] == 0, (kind, batch)
            elif batch == 4:
                assert gate.buckets[4].choice == 0
                assert widths[explore:explore + 150] == [None] * 150


def test_a_narrower_width_is_chosen_where_it_wins(caplog):
    """At 16 requests verifying all 7 drafts loses to plain steps, verifying 1 wins: the
    bucket drafts with 1 of 7 and says so; verifying 3 at a cost in between stays unchosen."""
    clock = Clock()
    alpha = synthetic_acceptance_rate(2.3, 7)
    engine = Engine(7, 1.0, {7: 2.6, 3: 1.9, 1: 1.2}, alpha, seed=3)    # 0.88 / 1.09 / 1.30 x plain
    gate = SpeculationGate(7, measured=True, clock=clock)
    with caplog.at_level(logging.INFO, logger="m3serve.core.spec_gate"):
        widths = _run(gate, clock, engine, 600, running=16)
    assert gate.buckets[16].choice == 1
    assert "on, 1 of 7 drafts verified, for 9-16 running requests" in caplog.text
    assert widths[100:].count(1) > 0.95 * 500


def test_drafts_that_lose_are_retried_and_come_back_when_acceptance_rises(caplog):
    """Drafts that lose (k 3, 1.5 tokens per verify at 2x a plain step) go off; each retry that
    loses doubles the wait before the next; when acceptance rises (3.6 tokens per verify) a
    retry turns them back on, with the retry's acceptance."""
    clock = Clock()
    engine = Engine(3, 1.0, {3: 2.0, 1: 1.6}, synthetic_acceptance_rate(1.5, 3), seed=0)
    gate = SpeculationGate(3, measured=True, clock=clock)
    widths = _run(gate, clock, engine, 4000, running=6)
    assert gate.buckets[8].choice == 0
    later = widths[100:]
    starts = [i for i in range(1, len(later)) if later[i] is not None and later[i - 1] is None]
    waits = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and waits[1] > 1.8 * waits[0] and waits[0] >= sg.DRAFT_PROBE_EVERY
    assert sum(w is not None for w in later) < 0.05 * len(later)
    engine.alpha = synthetic_acceptance_rate(3.6, 3)
    with caplog.at_level(logging.INFO, logger="m3serve.core.spec_gate"):
        widths = _run(gate, clock, engine, 4000, running=6)
    assert gate.buckets[8].choice == 3 and "on, 3 of 3 drafts verified, for 5-8" in caplog.text
    assert gate.acceptance.mean(3) == pytest.approx(3.6, abs=0.4)


def test_near_equal_rates_keep_what_runs():
    """Hysteresis: drafts 2 % faster than plain steps, once on, stay on (plain steps are not
    faster), 12 % slower go off; once off, drafts 3 % faster do not come back (every change
    costs steps no sample sees: drafts need a margin of 5 %), 15 % faster do."""
    k = 3
    clock = Clock()
    gate = SpeculationGate(k, measured=True, clock=clock)

    def engine(mean, seed):      # every draft kept with one probability; width 1 costs as much as 3
        return Engine(k, 1.0, {3: 2.0, 1: 2.0}, synthetic_acceptance_rate(mean, k), seed)
    _run(gate, clock, engine(2.4, 0), 200, running=4)                   # 1.2 vs 1.0: on
    assert gate.buckets[4].choice == 3
    widths = _run(gate, clock, engine(2.04, 1), 300, running=4)         # 1.02 vs 1.0
    assert gate.buckets[4].choice == 3 and widths[-100:].count(None) <= 3
    _run(gate, clock, engine(1.76, 2), 1000, running=4)                 # 0.88 vs 1.0
    assert gate.buckets[4].choice == 0
    _run(gate, clock, engine(2.06, 3), 3000, running=4)                 # 1.03 vs 1.0
    assert gate.buckets[4].choice == 0
    _run(gate, clock, engine(2.3, 4), 3000, running=4)                  # 1.15 vs 1.0
    assert gate.buckets[4].choice == 3


def test_a_bucket_that_cannot_time_plain_steps_speculates():
    clock = Clock()
    engine = Engine(3, 1.0, {3: 2.0, 1: 1.5}, synthetic_acceptance_rate(1.2, 3))
    gate = SpeculationGate(3, measured=True, clock=clock)
    widths = _run(gate, clock, engine, 600, running=4, plain_pause=1.0)
    explore = (1 + sg.MIN_SAMPLES) * 2
    assert widths[:explore] == [3] * 4 + [1] * 4
    assert widths[explore:explore + sg.EXPLORE_LIMIT] == [None] * sg.EXPLORE_LIMIT
    assert widths[explore + sg.EXPLORE_LIMIT:] == [3] * (600 - explore - sg.EXPLORE_LIMIT)


@pytest.mark.parametrize("case", ["prefill", "switch", "mixed widths", "pause"])
def test_only_steady_decode_steps_are_timed(case):
    clock = Clock()
    gate = SpeculationGate(3, measured=True, clock=clock)
    for i in range(20):
        if case == "prefill":           # steps with prompt chunks
            step = _step(3, 4, decode_only=False)
        elif case == "switch":          # drafts asked for, none to verify yet
            step = _step(0, 4)
        elif case == "mixed widths":    # requests verifying different numbers of drafts
            step = _step(3, 4)
            step.scheduled_spec_decode_tokens["r1"] = [1]
            step.num_scheduled_tokens["r1"] = 2
        else:                           # the loop waited between an output and the next step
            step = _step(3, 4)
            clock.t += 1.0
        gate.scheduled(step)
        clock.t += 2.0
        gate.observe(step)
    assert not gate.buckets.get(4) or not any(gate.buckets[4].periods.values())


def test_acceptance_after_plain_steps_waits_for_the_draft_to_settle():
    """Plain steps write no draft KV: the verify steps of the first SETTLE steps after one do
    not count towards the acceptance (a switch, verifying none, counts as a step)."""
    gate = SpeculationGate(3, measured=True, clock=Clock())
    for width in [None, 0, 3, 3, 3, 3, 3]:
        step = _step(width, 2)
        gate.scheduled(step)
        gate.observe(step, verified=[(width, 1)] * 2 if width else [])
    assert gate.acceptance.rows == 2 * (6 - sg.SETTLE)


def test_a_step_that_may_compute_prompt_tokens_runs_the_draft_pass_and_who_measures():
    """A step that may compute prompt tokens runs the draft pass where its prompts join a bucket
    that drafts (or has not chosen): in a bucket that chose plain steps it proposes drafts
    (width 0: its decodes verify none), elsewhere it verifies the bucket's width. Where they join
    a bucket that chose plain steps (and is not retrying drafts) it is a plain step, whatever
    its own bucket runs: the prompts' draft KV would go unread (the issue-49 batch of 4)."""
    from m3serve.core.spec_gate import measured_rule_applies
    clock = Clock()
    gate = SpeculationGate(7, measured=True, clock=clock)
    assert gate.draft_width(0, lambda: True, joining=lambda: 4) == 0          # nothing chosen yet
    _run(gate, clock, Engine.from_table("dspark", 4), 60, running=4)      # plain chosen for 3-4
    assert gate.buckets[4].choice == 0
    assert gate.draft_width(4, lambda: False) is None and gate.draft_width(4, lambda: True) is None
    assert gate.draft_width(0, lambda: True, joining=lambda: 4) is None       # four prompts arrive
    assert gate.draft_width(2, lambda: True, joining=lambda: 4) is None
    assert gate.draft_width(4, lambda: True, joining=lambda: 5) == 0          # they join bucket 8
    _run(gate, clock, Engine.from_table("dspark", 1), 100, running=1)
    k1 = gate.buckets[1].choice
    assert k1 > 0 and gate.draft_width(1, lambda: True) == k1
    assert gate.draft_width(0, lambda: True, joining=lambda: 1) == 0
    assert gate.draft_width(1, lambda: True, joining=lambda: 3) is None       # its bucket drafts, 3-4 not
    assert gate.draft_width(1, lambda: False, joining=lambda: 3) == k1
    gate.buckets[4].steps = gate.buckets[4].draft_every       # bucket 4 retries drafts now
    assert gate.draft_width(4, lambda: False) == 7 and gate.buckets[4].retry is not None
    assert gate.draft_width(0, lambda: True, joining=lambda: 4) == 0          # the retry reads their KV

    def config(dp=1, limit=None, method="eagle3"):
        return SimpleNamespace(speculative=SimpleNamespace(enabled=method is not None, disable_by_batch_size=limit),
                               parallel=SimpleNamespace(data_parallel_size=dp))
    assert measured_rule_applies(config(), "cuda")
    assert not any([measured_rule_applies(config(), "cpu"), measured_rule_applies(config(dp=2), "cuda"),
                    measured_rule_applies(config(limit=4), "cuda"), measured_rule_applies(config(method=None), "cuda")])


def test_noisy_acceptance_does_not_turn_winning_drafts_off():
    """One request, k = 7 drafts kept as a synthetic run keeps them (mean 2.3 tokens a step,
    1 to 8 from step to step) at 2x a plain step's cost: drafts win by 15 % (3 of 7 by 6 %, 1
    of 7 lose). In each of 20 runs the bucket ends with drafts, plain steps only in its
    exploring and re-timings, or until the first retry where its first choice missed."""
    alpha = synthetic_acceptance_rate(2.3, 7)
    for seed in range(20):
        clock = Clock()
        engine = Engine(7, 1.0, {7: 2.0, 3: 1.95, 1: 1.6}, alpha, seed)
        gate = SpeculationGate(7, measured=True, clock=clock)
        widths = _run(gate, clock, engine, 3000, running=1)
        assert gate.buckets[1].choice in (7, 3), seed
        # plain steps after exploring: re-timings, and where the first choice missed, until a retry
        assert widths[100:].count(None) < 0.1 * 2900, seed


def test_noisy_acceptance_turns_losing_drafts_off():
    """The same spread at 2.54x a plain step's cost at 4 requests (the narrower widths lose as
    well): drafts lose by 9 %. Each of 20 runs turns them off, and drafts run in under 10 %
    of the steps, exploring and retries included."""
    alpha = synthetic_acceptance_rate(2.3, 7)
    drafted = 0
    for seed in range(20):
        clock = Clock()
        engine = Engine(7, 1.0, {7: 2.54, 3: 2.3, 1: 1.75}, alpha, seed)
        gate = SpeculationGate(7, measured=True, clock=clock)
        widths = _run(gate, clock, engine, 3000, running=4)
        assert gate.buckets[4].choice == 0, seed
        drafted += sum(w is not None for w in widths)
    assert drafted < 0.1 * 20 * 3000


def test_one_slow_step_does_not_decide():
    """The period is the median of the timed steps': one step slowed 50x (a collection, another
    process) among drafted steps that win 2 : 1 leaves the choice as it was."""
    clock = Clock()
    engine = Engine(3, 1.0, {3: 1.0, 1: 1.0}, synthetic_acceptance_rate(2.0, 3))
    gate = SpeculationGate(3, measured=True, clock=clock)
    _run(gate, clock, engine, 60, running=2)
    assert gate.buckets[2].choice == 3
    gate.buckets[2].add(3, 50.0)
    _run(gate, clock, engine, 5, running=2)
    assert gate.buckets[2].choice == 3 and gate.buckets[2].period(3) == pytest.approx(1.0)


def test_deferred_plain_steps_are_timed(monkeypatch):
    """Async scheduling: a plain step's output comes back after the next step was scheduled
    and launched. Each step keeps its own schedule time, so such steps are still timed, at the
    loop's period between outputs -- except the one whose output a landing step brings (it
    launches nothing, so that period is short) -- and the bucket compares them with drafts."""
    monkeypatch.setattr(sg, "SAMPLES", 10_000)                          # keep every timed step
    clock = Clock()
    gate = SpeculationGate(1, measured=True, clock=clock)
    pending, had_drafts = None, True    # the deferred plain step whose output comes next
    landings = 0
    for _ in range(1000):               # past retries of drafts, each after a landing step
        width = gate.draft_width(4)
        if width is not None and pending is not None:   # drafts wait for it: a landing step
            landing = _step(None, 0)
            gate.scheduled(landing)
            clock.t += 0.1
            gate.observe(pending)
            gate.observe(landing)
            pending, landings = None, landings + 1
            continue
        step = _step(width if width is None or had_drafts else 0, 4, deferred=width is None)
        gate.scheduled(step)
        clock.t += 3.0 if step.scheduled_spec_decode_tokens else 1.0
        if pending is not None:         # this step's launch lands the previous one's output
            gate.observe(pending)
            pending = None
        if width is not None:
            drafted = bool(step.scheduled_spec_decode_tokens)
            gate.observe(step, verified=[(1, 1), (1, 1), (1, 0), (1, 0)] if drafted else [])
        else:
            pending = step
        had_drafts = width is not None
    bucket = gate.buckets[4]
    assert landings >= 2
    assert len(bucket.periods[0]) >= sg.MIN_SAMPLES                     # deferred plain steps timed
    assert all(period == pytest.approx(1.0) for period in bucket.periods[0])
    assert bucket.choice == 0                                           # 1.5 / 3 s < 1 / 1 s


def test_finish_spread_of_equal_requests_matches_a_simulation():
    """The finish spread's estimate of how much longer b requests of N tokens take to all finish
    than one on average, against a simulation of the synthetic rule (DSpark k 7 at 2.3 verifying
    3 drafts, 128 tokens): within a third at 4 and 16 requests, none for one."""
    from m3serve.core.spec_gate import finish_spread
    alpha, width, n = synthetic_acceptance_rate(2.3, 7), 3, 128
    acc, rng = Acceptance(7, rows=100_000), random.Random(5)
    for _ in range(4000):
        kept = 0
        while kept < width and rng.random() < alpha:
            kept += 1
        acc.add(width, kept)
    mean, sd = acc.mean(width), acc.spread(width)
    assert finish_spread(1, n, mean, sd) == 0.0 and finish_spread(4, None, mean, sd) == 0.0

    def steps_to_finish(b):
        done, steps = [0] * b, 0
        while min(done) < n:
            steps += 1
            for i in range(b):
                if done[i] < n:
                    kept = 0
                    while kept < width and rng.random() < alpha:
                        kept += 1
                    done[i] += 1 + kept
        return steps
    one = sum(steps_to_finish(1) for _ in range(400)) / 400
    for b in (4, 16):
        simulated = sum(steps_to_finish(b) for _ in range(400)) / 400 / one - 1
        assert finish_spread(b, n, mean, sd) == pytest.approx(simulated, rel=0.34), b


def test_issue_49_dspark_narrow_width_that_wins_only_in_steady_steps_goes_plain():
    """As measured at one TP 8 rank (H100, fp8, tree f45b1ce): DSpark k 7 at 2.3 at 4 requests,
    verifying 3 drafts every 14.61 ms against plain steps every 7.31 ms -- 7 % faster per token
    in steady steps, yet the 128-token run was 9 % slower than plain steps (its requests stop
    apart). With the requests' length the bucket runs plain steps (but for its retries of
    drafts, one of which may win on a short retry's acceptance until the loss is clear again);
    not told it, it mostly drafts with 3 of 7."""
    def engine(seed):
        alpha = synthetic_acceptance_rate(2.3, 7)
        return Engine(7, 7.31e-3, {7: 18.6e-3, 3: 14.61e-3, 1: 12.0e-3}, alpha, seed)
    blind_drafts = 0
    for seed in range(6):
        told = SpeculationGate(7, measured=True, clock=Clock())
        widths = _run(told, told.clock, engine(seed), 400, running=4, length=128)
        assert told.buckets[4].choice == 0 and widths[16:].count(None) > 0.6 * 384, seed
        blind = SpeculationGate(7, measured=True, clock=Clock())
        widths = _run(blind, blind.clock, engine(seed), 400, running=4)
        blind_drafts += blind.buckets[4].choice == 3 and widths[-100:].count(3) >= 90
    assert blind_drafts >= 4


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_issue_49_winning_drafts_stay_on_with_the_finish_spread(kind):
    """EAGLE3 at 2.78 (batch 1 / 4 / 16) and DSpark at 3.0 (its measured periods at 4 and 16
    requests, tree f45b1ce) win by 25 % or more: 128-token requests keep them on."""
    if kind == "eagle3":
        cases = [Engine.from_table("eagle3", b, seed=b) for b in (1, 4, 16)]
        runs = zip((1, 4, 16), cases)
    else:
        alpha = synthetic_acceptance_rate(3.0, 7)
        runs = [(4, Engine(7, 7.29e-3, {7: 17.49e-3, 3: 14.59e-3, 1: 11.86e-3}, alpha, 1)),
                (16, Engine(7, 12.44e-3, {7: 26.95e-3, 3: 24.06e-3, 1: 20.5e-3}, alpha, 2))]
    clock = Clock()
    gate = SpeculationGate(7 if kind == "dspark" else 3, measured=True, clock=clock)
    for batch, engine in runs:
        widths = _run(gate, clock, engine, 300, running=batch, length=128)
        assert gate.buckets[batch].choice, (kind, batch)
        assert widths[-100:].count(None) <= 2, (kind, batch)
