"""How many drafts a step verifies (none: a plain step), by the number of running requests.

Drafts pay when the tokens they add per verify step outweigh what the verify and draft passes
cost over a plain decode step; both sides move with the batch size (a verify step reads the
experts of every draft row, so verifying fewer drafts costs fewer rows), the model, the
hardware and the workload's acceptance. Three rules, one per engine:

- fixed (`speculative_config.disable_by_batch_size` N): steps with N or more running requests
  decode without drafts, smaller ones verify all k;
- measured (the default on a GPU with one DP replica), below;
- always (CPU engines, where wall-clock times describe nothing served, and DP replicas, whose
  steps wait for each other): every step verifies k drafts.

The measured rule. Per bucket of running requests (rounded up to a power of two) the engine
runs one arm: plain steps, or verifying the first j of each request's k drafts, for a width j
of `draft_widths(k)` (k, and 1, 3, 7, ... below it). Each arm is rated in tokens emitted per
request per second:
- plain steps: 1 over the arm's period;
- width j: E[T_j] over the arm's period. E[T_j] = 1 + sum over i <= j of P(K >= i), the mean
  number of tokens a verify of j drafts emits, K the drafts a request keeps: the product over
  positions l <= i of the fraction of drafts at l that were kept when verified after kept
  drafts, each position over its last `ACCEPT_ROWS` such verify steps in the whole engine
  (acceptance is the traffic's, not the batch size's: buckets share it, so a bucket met late
  starts with it), drawn towards the fraction over all positions by `SHRINK` verify steps (a
  deep position few steps reached says little of its own). Verify steps of the first `SETTLE`
  steps after a plain one do not count: plain steps write no draft KV, so drafts accept less
  until it refills -- a cost of switching, not of the arm. Its standard error is that of a
  mean of T_j over those verify steps, with the variance the acceptance implies;
- the period: the median of the arm's last `SAMPLES` timed steps in that bucket (a verify
  step emits 1 to k + 1 tokens per request, so acceptance needs many steps, a period few);
- the finish spread: a width's rate is divided by 1 + m_b sd(T_j) / sqrt(N E[T_j]), N the
  running requests' mean output budget (max_tokens, or what the context leaves) and m_b the mean
  of the largest of b standard normals, b the running requests. Requests that verify drafts emit
  a random number of tokens per step, so requests of equal length that start together stop
  apart: the steps one needs for N tokens spread by sd(T_j) sqrt(N / E[T_j]^3) (renewal), and
  the batch ends with its slowest, m_b such spreads after the mean. Plain steps emit one token
  each and keep them together. (Measured at one TP 8 rank: DSpark k 7 at acceptance 2.3 verifying
  3 drafts at 4 requests was 7 % faster per token in its steady steps, and the run 9 % slower
  than plain steps, 128-token requests.)

A bucket first times each arm for `MIN_SAMPLES` steps, widest first, plain steps last (plain
steps damage the draft's KV), in decode-only steps: until its first choice, a step that
computes prompt tokens only writes the draft's KV (it is not timed, and as a plain step to the
ranks it is deferred like one), as does a step with no running request. It
then chooses as soon as the choice is clear -- the fastest width beats plain steps by `Z`
standard errors of its rate, or plain steps beat every width by Z of that width's -- or once
the acceptance rests on `DECIDE_ROWS` verify steps (until then it verifies all k drafts, which
adds to every position's): the fastest width if it beats plain steps by `MARGIN`, else plain
steps.
Window: with the acceptance known and drafts slower than plain steps by Z standard errors, a
fresh bucket runs plain steps from its (1 + MIN_SAMPLES) x len(draft_widths(k)) + 2 +
MIN_SAMPLES -th step on (17 for DSpark's k = 7, 13 for k = 3; on a fresh engine the acceptance
needs MIN_DRAFT_ROWS verify steps first, within those at 4 requests or more).
After the choice:
- drafting at width j: plain steps as soon as they beat every width by `Z_OFF` standard errors
  of its rate (the error falls as drafted steps add verify steps: drafts that lose cannot stay
  on); another width once it beats j by MARGIN (no switching cost: the requests keep drafting);
  plain steps re-timed every `PLAIN_PROBE_EVERY` steps, the other widths in turn every
  `WIDTH_PROBE_EVERY`;
- plain steps: every `DRAFT_PROBE_EVERY` steps (twice as long after each retry that loses, up
  to `DRAFT_PROBE_MAX_EVERY`) drafts are retried at width k with their acceptance timed afresh
  (it drifts with the traffic; old verify steps would outweigh a short retry's), decided as a
  first choice is, except that a retry ends early only where drafts clearly lose: it turns them
  back on only with DECIDE_ROWS verify steps behind it (checked at every step, an early "win"
  would mostly be a lucky run); a retry that turns drafts on gives the engine its acceptance.
A bucket that cannot time an arm within `EXPLORE_LIMIT` steps (too few steady decode steps
there) verifies k drafts for PLAIN_PROBE_EVERY steps, then tries again. Each change of a
bucket's arm is logged with each arm's rate and its parts.

Plain steps are deferred like any engine's (async scheduling, where the engine has it: their
tokens stay on the device and the next step is scheduled before they land), so they are timed as
they run when the bucket chooses them. A step with drafts is never deferred, and drafts need the
newest tokens on the host: when drafts follow a deferred plain step, the scheduler first takes a
step that only lands its tokens (`Scheduler.num_landing_steps`), then a switch step (width 0:
no drafts to verify yet, it proposes them), which is timed for no arm. A step that may compute
prompt tokens runs the draft pass whatever its own bucket chose (it writes the prompt's draft
KV); in a bucket that chose plain steps its decodes verify none and, on the eager path, it
proposes none either (`SchedulerOutput.propose`: the next plain step would drop them). The
exception: where the requests that will run once the waiting ones are admitted fall in a bucket
that chose plain steps (and is not retrying drafts), the step is a plain one, without the draft
pass, deferred like any -- its prompts' draft KV would go unread. (Measured at one TP 8 rank,
DSpark, 8K prompts: with the draft pass the prompt steps of a batch of 4 took about 120 ms more
than plain ones, 0.8 ms of peer TPOT at 128 output tokens, although its buckets ran plain steps.)

A timed step is decode-only (each request computes its next token and exactly the arm's number
of drafts) and of the same arm and bucket as the step before it; its time is from the previous
step's output to its own (the loop's period, host work included), unless the loop paused
(`MAX_GAP`).
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from functools import lru_cache

logger = logging.getLogger(__name__)

MIN_SAMPLES = 3            # timed steps of an arm before its period counts
SAMPLES = 8                # timed steps kept per bucket and arm (their periods)
MIN_DRAFT_ROWS = 16        # requests' verify steps behind the acceptance before drafts are rated
DECIDE_ROWS = 128          # ... and before a choice between near-equal rates (or a retry's end)
ACCEPT_ROWS = 512          # verify steps kept per draft position
SHRINK = 2                 # verify steps at all positions' kept fraction added to each position's
SETTLE = 4                 # steps after a plain one whose acceptance is not counted (the draft's KV refills)
Z = 1.5                    # standard errors by which a first choice (or a retry's) is clear
Z_OFF = 1.0                # ... and by which plain steps must win to turn drafts off
MARGIN = 0.05              # drafts replace plain steps (or a width the running one) only this much faster
PLAIN_PROBE_EVERY = 1000   # steps with drafts between two re-timings of plain steps
WIDTH_PROBE_EVERY = 250    # steps with drafts between two re-timings of another width
DRAFT_PROBE_EVERY = 200    # plain steps between two retries of drafts (each: a landing step,
                           # a switch, then until the arm is timed and its acceptance is clear)
DRAFT_PROBE_MAX_EVERY = 8 * DRAFT_PROBE_EVERY   # a retry that loses doubles the wait, up to this
EXPLORE_LIMIT = 64         # steps a bucket may spend timing one arm
MAX_GAP = 0.05             # s between an output and the next step's schedule: longer = the loop paused


def measured_rule_applies(config, device_type: str) -> bool:
    """Whether an engine of `config` on `device_type` ranks picks the batches that speculate by
    measurement (the engine core's gate, and the worker's plain graphs at every size)."""
    return (config.speculative.enabled and config.speculative.disable_by_batch_size is None
            and device_type == "cuda" and config.parallel.data_parallel_size == 1)


def rule_of(config, device_type: str) -> str:
    """The rule an engine of `config` on `device_type` ranks runs (`SpeculationGate.rule`)."""
    if config.speculative.disable_by_batch_size is not None:
        return "fixed"
    return "measured" if measured_rule_applies(config, device_type) else "always"


def draft_widths(k: int) -> list[int]:
    """The numbers of drafts a request may verify under the measured rule, widest first: k and
    2^i - 1 below it (k 7: 7, 3, 1; k 3: 3, 1)."""
    return sorted({k} | {(1 << i) - 1 for i in range(1, k.bit_length() + 1) if (1 << i) - 1 < k}, reverse=True)


def bucket_of(num_running: int) -> int:
    """Running requests rounded up to a power of two."""
    return 1 << max(0, num_running - 1).bit_length()


class Acceptance:
    """Per draft position i (1..k): whether the draft there was kept, over the last `rows` verify
    steps of a request that reached it (verified it, with every draft before it kept)."""

    def __init__(self, k: int, rows: int = ACCEPT_ROWS):
        self.kept = [deque(maxlen=rows) for _ in range(k)]
        self.sums = [0] * k

    @property
    def rows(self) -> int:
        """Verify steps behind the first position's figure (every verify step reaches it)."""
        return len(self.kept[0])

    def add(self, num_drafts: int, num_kept: int) -> None:
        """One request's verify step: `num_kept` of its `num_drafts` drafts kept."""
        for i in range(min(num_kept + 1, num_drafts)):
            window, hit = self.kept[i], i < num_kept
            if len(window) == window.maxlen:
                self.sums[i] -= window[0]
            window.append(hit)
            self.sums[i] += hit

    def renew(self, newer: "Acceptance") -> None:
        """Take `newer`'s figures for every position it has any of."""
        for i, window in enumerate(newer.kept):
            if window:
                self.kept[i], self.sums[i] = deque(window, maxlen=self.kept[i].maxlen), newer.sums[i]

    def tail(self, j: int, prior: float = 0.0) -> list[float]:
        """P(K >= i) for i = 1..j, K the drafts a verify keeps: the product of the positions'
        kept fractions, each drawn towards the fraction over all positions by `SHRINK` verify
        steps (a deep position that few steps reached, or none, says little of its own; drafts'
        acceptance changes slowly with the position) and given `prior` halves of a kept and a
        rejected draft (for the variance)."""
        reached = sum(len(w) for w in self.kept)
        pooled = sum(self.sums) / reached if reached else 0.0
        out, p = [], 1.0
        for i in range(j):
            n = len(self.kept[i])
            p *= (self.sums[i] + SHRINK * pooled + prior / 2) / (n + SHRINK + prior)
            out.append(p)
        return out

    def mean(self, j: int) -> float:
        """E[T_j]: tokens a verify of j drafts emits per request, on average."""
        return 1.0 + sum(self.tail(j))

    def spread(self, j: int) -> float:
        """sd(T_j), the spread of the tokens one verify of j drafts emits (with the prior of
        `error`); 0 before any verify step."""
        if not self.rows:
            return 0.0
        tail = self.tail(j, prior=1.0)
        mean = sum(tail)
        return math.sqrt(max(sum((2 * i + 1) * q for i, q in enumerate(tail)) - mean * mean, 0.0))

    def error(self, j: int) -> float:
        """Standard error of `mean(j)`: the variance of T_j the acceptance implies (each
        position's fraction given half a kept and half a rejected draft more, so that a few
        steps that kept nothing do not claim none ever will) over the verify steps behind it."""
        if not self.rows:
            return math.inf
        return self.spread(j) / math.sqrt(self.rows)


@lru_cache(maxsize=None)
def expected_max_normal(b: int) -> float:
    """E[max of b independent standard normals] (0 for one), by the midpoint rule on [-8, 8]:
    the integral of x b phi(x) Phi(x)^(b - 1)."""
    if b <= 1:
        return 0.0
    n, lo, hi = 4000, -8.0, 8.0
    h = (hi - lo) / n
    total = 0.0
    for i in range(n):
        x = lo + (i + 0.5) * h
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        below = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * b * density * below ** (b - 1)
    return total * h


def finish_spread(num_running: int, length: float | None, mean: float, sd: float) -> float:
    """The fraction by which `num_running` requests of `length` output tokens each, verifying
    drafts that emit `mean` +- `sd` tokens per step, take longer than their mean to all finish
    (see the module docstring); 0 without a length."""
    if not length or num_running <= 1 or mean <= 0:
        return 0.0
    return expected_max_normal(num_running) * sd / math.sqrt(length * mean)


class _Bucket:
    """One bucket's periods per arm (0: plain, j: j drafts) and where its choice stands."""

    def __init__(self, widths: list[int]):
        self.periods = {arm: deque(maxlen=SAMPLES) for arm in [*widths, 0]}
        self.num_timed = dict.fromkeys(self.periods, 0)   # timed steps per arm, ever
        self.explore = [*widths, 0]          # arms still to time before the first choice
        self.choice: int | None = None       # None: not chosen yet
        self.probe: int | None = None        # the arm being timed (exploring, a retry or a re-timing)
        self.probe_from = 0                  # ... its timed steps when it began
        self.probe_steps = 0                 # ... steps spent on it
        self.retry: Acceptance | None = None  # a retry of drafts: its own acceptance
        self.steps = 0                       # steps since the choice or the last retry of drafts
        self.width_steps = 0                 # ... since the last re-timing of a width
        self.next_width = 0                  # ... which one is re-timed next
        self.hold = 0                        # steps to verify k drafts before exploring again
        self.running = 1                     # running requests at its latest step
        self.draft_every = DRAFT_PROBE_EVERY  # plain steps between retries of drafts

    def period(self, arm: int) -> float | None:
        samples = self.periods[arm]
        return statistics.median(samples) if len(samples) >= MIN_SAMPLES else None

    def add(self, arm: int, period: float) -> None:
        self.periods[arm].append(period)
        self.num_timed[arm] += 1

    def start_probe(self, arm: int) -> None:
        self.probe, self.probe_from, self.probe_steps = arm, self.num_timed[arm], 0

    def probe_timed(self, need: int) -> bool:
        """Whether the arm being timed has `need` timed steps since it began."""
        return self.num_timed[self.probe] - self.probe_from >= need


class SpeculationGate:
    """`draft_width(...)` before each step; `scheduled(step)` once it is built; `observe(...)`
    with its result. `k`: the drafts a request has; `fixed`: disable_by_batch_size (None: not
    fixed); `measured`: the timed rule (else always). `clock`: seconds, monotonic."""

    def __init__(self, k: int, fixed: int | None = None, measured: bool = False, clock=time.monotonic):
        self.k = k
        self.fixed, self.measured, self.clock = fixed, measured and fixed is None, clock
        self.widths = draft_widths(k) if k else []
        self.buckets: dict[int, _Bucket] = {}
        self.acceptance = Acceptance(k) if k else None
        self._on = True                          # the fixed rule's state, for its log lines
        # (step, when it was scheduled) of the steps whose output has not come yet, in order: a
        # plain step may be deferred (async scheduling), its output coming after the next step
        # was scheduled
        self._scheduled: deque = deque()
        self._last: tuple | None = None          # (timing key, output time) of the previous step
        self._since_plain = SETTLE + 1           # speculating steps since the last plain one
        self._length = lambda: None              # the running requests' mean output budget

    @property
    def rule(self) -> str:
        return "fixed" if self.fixed is not None else "measured" if self.measured else "always"

    # ------------------------------------------------------------ choosing

    def draft_width(self, num_running: int, prompt_due=lambda: False, length=lambda: None,
                    joining=None) -> int | None:
        """How many drafts each request verifies in the next step: None for a plain step (no
        draft pass), else a width of 0..k (0: the step only proposes drafts). `prompt_due()`:
        whether the step may compute prompt tokens (asked only under the measured rule, which
        then runs the draft pass so that the draft's KV holds the prompt -- unless the prompts
        join a bucket that chose plain steps; in a bucket that chose plain steps its decodes
        verify none). `length()`: the running requests' mean output budget in tokens (None:
        unknown; the finish spread). `joining()`: the requests that will run once the waiting
        ones are admitted (None: `num_running`)."""
        if self.fixed is not None:
            on = num_running < self.fixed
            if on != self._on:
                logger.info("speculative decoding %s: %d requests running (disable_by_batch_size %d)",
                            "back on" if on else "off", num_running, self.fixed)
                self._on = on
            return self.k if on else None
        if not self.measured:
            return self.k
        joining = joining or (lambda: num_running)
        if num_running == 0:
            # prompts only: the draft writes their KV (decode steps choose), unless they join a
            # bucket that runs plain steps
            return None if self._joins_plain(joining) else 0
        b = bucket_of(num_running)
        state = self.buckets.get(b)
        if state is None:
            state = self.buckets[b] = _Bucket(self.widths)
        state.running, self._length = num_running, length
        if self._joins_plain(joining) and prompt_due():   # (a dict lookup first: prompt_due walks the batch)
            return None          # the prompts' requests will run plain steps: no draft pass
        if state.choice is None and not state.hold and prompt_due():
            # a bucket still timing its arms does so in decode-only steps: a step that computes
            # prompt tokens is not timed, and verifying drafts in it only keeps it from being
            # deferred like a plain step
            return 0
        arm = self._arm(state, b)
        if arm == 0:
            return 0 if prompt_due() else None
        return arm

    def _joins_plain(self, joining) -> bool:
        """Whether the requests that will run once the waiting ones are admitted (`joining()`)
        fall in a bucket that chose plain steps and is not timing drafts: their prompts' draft
        KV would go unread (plain steps verify no drafts; a later retry or a smaller batch that
        drafts reads holes there, see core/kv_cache/draft_window.py), so a step that computes
        prompt tokens runs without the draft pass, deferred like a plain step."""
        state = self.buckets.get(bucket_of(max(1, joining())))
        return state is not None and state.choice == 0 and state.probe is None

    def _arm(self, state: _Bucket, b: int) -> int:
        if state.hold:
            state.hold -= 1
            return self.k
        state.steps += 1
        while state.probe is not None or state.explore:
            if state.probe is None:
                state.start_probe(state.explore.pop(0))
            arm = self._probing(state, b)
            if arm is not None:
                return arm
        if state.choice is None:                 # timed every arm, the choice still unclear
            return self.k if self._decide(state, b) is None else state.choice
        if state.choice == 0:
            if state.steps >= state.draft_every:   # retry drafts (all k: every position's acceptance)
                state.retry = Acceptance(self.k)
                state.start_probe(self.k)
                return state.probe
            return 0
        self._decide(state, b)
        if state.choice and state.steps >= PLAIN_PROBE_EVERY:
            state.steps = 0
            state.start_probe(0)
        elif state.choice and len(self.widths) > 1 and state.width_steps >= WIDTH_PROBE_EVERY:
            others = [w for w in self.widths if w != state.choice]
            state.width_steps, state.next_width = 0, state.next_width + 1
            state.start_probe(others[state.next_width % len(others)])
        else:
            state.width_steps += bool(state.choice)
            return state.choice
        return state.probe

    def _probing(self, state: _Bucket, b: int) -> int | None:
        """The arm to run while one is being timed, or None once it is (or cannot be)."""
        state.probe_steps += 1
        retry = state.retry
        need = 1 if state.choice is not None and retry is None else MIN_SAMPLES
        timed = state.probe_timed(need)
        if retry is not None:                    # a retry ends once its acceptance is clear too
            timed = timed and self._retry_clear(state, retry)
        # a retry may take the verify steps a choice needs (DECIDE_ROWS over the running requests)
        limit = EXPLORE_LIMIT
        if retry is not None:
            limit += SETTLE + -(-DECIDE_ROWS // max(1, state.running))
        if not timed and state.probe_steps <= limit:
            return state.probe
        arm, state.probe = state.probe, None
        if retry is not None:
            state.retry, state.steps = None, 0
            if timed and self._decide(state, b, retry):
                self.acceptance.renew(retry)     # drafts back on by the newest acceptance: the engine's now
            if state.choice == 0:                # (none timed: plain steps stay)
                state.draft_every = min(2 * state.draft_every, DRAFT_PROBE_MAX_EVERY)
            else:
                state.draft_every = DRAFT_PROBE_EVERY
            return None
        if not timed and state.choice is None:   # too few steady decode steps here to time it
            state.explore = [arm, *state.explore]
            state.steps, state.hold = 0, PLAIN_PROBE_EVERY
            return self.k
        return None

    def _retry_clear(self, state: _Bucket, retry: Acceptance) -> bool:
        if retry.rows < MIN_DRAFT_ROWS:
            return False
        rates, plain = self._rates(state, retry), state.period(0)
        # ends early only on a clear loss: a short retry's acceptance that happens to be high
        # must not turn drafts back on (its end is checked at every step)
        return (retry.rows >= DECIDE_ROWS or not rates or plain is None
                or all(1 / plain - rate > Z * err for _, rate, err in rates))

    def _rates(self, state: _Bucket, acceptance: Acceptance) -> list[tuple[int, float, float]]:
        """(width, tokens per request per second, its standard error) of each timed width, the
        fastest first; none while the acceptance rests on fewer than MIN_DRAFT_ROWS verify steps."""
        if acceptance.rows < MIN_DRAFT_ROWS:
            return []
        length, rates = self._length(), []
        for w in self.widths:
            if (p := state.period(w)) is not None:
                mean = acceptance.mean(w)
                slow = p * (1 + finish_spread(state.running, length, mean, acceptance.spread(w)))
                rates.append((w, mean / slow, acceptance.error(w) / slow))
        return sorted(rates, key=lambda r: -r[1])

    @staticmethod
    def _clear(rates, plain: float, z: float) -> bool:
        """Whether the fastest width beats plain steps by z standard errors of its rate, or plain
        steps beat every width by z of that width's."""
        _, best, error = rates[0]
        return best - plain > z * error or all(plain - rate > z * err for _, rate, err in rates)

    def _decide(self, state: _Bucket, b: int, retry: Acceptance | None = None) -> int | None:
        """Set the bucket's arm from its periods and the acceptance (a retry's: its own); None
        while the first choice (or the retry's) is not clear yet (see the module's docstring)."""
        acceptance, plain_period = retry or self.acceptance, state.period(0)
        rates = self._rates(state, acceptance)
        if plain_period is None or not rates:
            return state.choice
        plain, (width, rate, _) = 1 / plain_period, rates[0]
        current = state.choice
        if current is None or retry is not None:
            if not self._clear(rates, plain, Z) and acceptance.rows < DECIDE_ROWS:
                return None
            choice = width if rate > plain * (1 + MARGIN) else 0
        elif all(plain - r > Z_OFF * err for _, r, err in rates):
            choice = 0
        else:
            running = next((r for w, r, _ in rates if w == current), 0.0)
            choice = width if width != current and rate > running * (1 + MARGIN) else current
        if choice != current:
            self._log(state, b, choice, plain, acceptance)
            state.choice, state.steps, state.width_steps = choice, 0, 0
        return choice

    def _log(self, state: _Bucket, b: int, choice: int, plain: float, acceptance: Acceptance) -> None:
        span = f"{b // 2 + 1}-{b}" if b > 1 else "1"
        parts = []
        for w in self.widths:
            period = state.period(w)
            if period is not None:
                mean = acceptance.mean(w)
                spread = finish_spread(state.running, self._length(), mean, acceptance.spread(w))
                parts.append(f"{w} of {self.k} drafts {mean / period / (1 + spread):.1f} "
                             f"({mean:.2f} tokens per request every {period * 1e3:.2f} ms, "
                             f"finish spread {spread:.1%})")
        what = "off" if choice == 0 else f"on, {choice} of {self.k} drafts verified,"
        logger.info("speculative decoding %s for %s running requests (measured, tokens/s per request: "
                    "plain %.1f (every %.2f ms); %s; acceptance over %d verify steps)", what, span,
                    plain, 1e3 / plain, "; ".join(parts), acceptance.rows)

    def summary(self) -> dict:
        """Per bucket: its arm (None: not chosen) and each timed arm's period (ms); and the
        acceptance behind the rates: E[T_j] per width and its verify steps."""
        acc = self.acceptance
        return {"buckets": {b: {"choice": s.choice, "period_ms": {
                    arm: round(s.period(arm) * 1e3, 3) for arm in s.periods if s.period(arm) is not None}}
                            for b, s in sorted(self.buckets.items())},
                "tokens_per_verify": {w: round(acc.mean(w), 3) for w in self.widths} if acc else {},
                "verify_steps": acc.rows if acc else 0}

    # ------------------------------------------------------------ timing

    def scheduled(self, step) -> None:
        """`step` (a SchedulerOutput) was scheduled now."""
        if self.measured:
            self._scheduled.append((step, self.clock()))

    def observe(self, step, num_requests: int | None = None, verified=()) -> None:
        """`step`'s output arrived (a SchedulerOutput): `num_requests` of its requests emitted
        tokens (None: every one); `verified`: (drafts, drafts kept) of each request that
        verified drafts."""
        if not self.measured:
            return
        now, started = self.clock(), None
        while self._scheduled:                   # outputs come in the order steps were scheduled
            pending, when = self._scheduled.popleft()
            if pending is step:
                started = when
                break
        deferred = step.deferred
        if deferred:
            # Its output came back with the next step's launch, so its period is a steady one
            # only if that step was deferred too (one that is not returns after its own
            # sampling; a landing step launches nothing), and a pause of the loop shows at that
            # step's schedule.
            following = self._scheduled[0] if self._scheduled else None
            started = following[1] if following is not None and following[0].deferred else None
        spec, rows = step.scheduled_spec_decode_tokens, step.num_scheduled_tokens
        if rows:
            self._since_plain = self._since_plain + 1 if step.speculate else 0
        if self._since_plain > SETTLE:
            for num_drafts, num_kept in verified:
                self.acceptance.add(num_drafts, num_kept)
                if self._retrying is not None:
                    self._retrying.add(num_drafts, num_kept)
        arm = self._arm_of(step, spec, rows)
        num_rows = len(rows)
        # a step is timed only after one of the same arm, bucket and deferral: a step that is
        # not deferred, after one that was, returns with that one's output (no period of its own)
        key = (arm, bucket_of(num_rows), deferred) if arm is not None and num_rows else None
        last, self._last = self._last, (key, now)
        if key is None or last is None or last[0] != key or started is None or started - last[1] > MAX_GAP:
            return
        if num_requests is not None and num_requests != num_rows:
            return                               # some rows emitted nothing (finished or aborted)
        period = now - last[1]
        if period > 0:
            state = self.buckets.get(key[1])
            if state is None:
                state = self.buckets[key[1]] = _Bucket(self.widths)
            state.add(arm, period)

    @property
    def _retrying(self) -> Acceptance | None:
        """The acceptance of the retry of drafts under way, if any (one bucket runs at a time)."""
        return next((s.retry for s in self.buckets.values() if s.retry is not None), None)

    @staticmethod
    def _arm_of(step, spec, rows) -> int | None:
        """The arm a decode-only step ran (0: plain; j: every request verified j drafts), or
        None: a step that computes more (prompt tokens), mixes widths, or speculates without
        drafts to verify (a switch)."""
        if not step.speculate:
            return 0 if not spec and all(n == 1 for n in rows.values()) else None
        widths = {len(spec.get(r, ())) for r in rows}
        if len(widths) != 1:
            return None
        width = widths.pop()
        return width if width and all(n == 1 + width for n in rows.values()) else None
