"""Whether a step speculates, by the number of running requests.

Drafts pay when the tokens they add per verify step outweigh what the verify and draft passes
cost over a plain decode step; both sides move with the batch size (a verify step reads the
experts of every draft row), the model, the hardware and the workload's acceptance. Three
rules, one per engine:

- fixed (`speculative_config.disable_by_batch_size` N): steps with N or more running requests
  decode without drafts;
- measured (the default on a GPU with one DP replica): per bucket of running requests (rounded
  up to a power of two), the engine times its decode-only steps with drafts and without, as
  tokens emitted per request per second (mean tokens per request over the median period of the
  last `SAMPLES` steps of each kind; for drafts the mean is over the last `ACCEPT_ROWS`
  requests' verify steps: a verify step emits 1 to k + 1 tokens per request as drafts are
  accepted, so only a mean over many counts them right, while the median period keeps one slow
  step from deciding), and speculates where drafts give more. A bucket starts with drafts,
  takes `MIN_SAMPLES` timed steps of each kind (and `MIN_DRAFT_ROWS` requests' verify steps),
  then keeps the faster kind -- the kind running (drafts, at first) stays unless the other is
  faster by `MARGIN`, since every change costs steps outside steady decode that no sample
  sees, and drafts go off only when also slower by `Z_OFF` standard errors of their rate --
  and retries the other now and then (acceptance and costs drift with the traffic): plain
  steps for `PLAIN_PROBE_STEPS` every `PLAIN_PROBE_EVERY` steps while drafts win; while plain
  wins, drafts every `DRAFT_PROBE_EVERY` steps, timed anew until they have `MIN_SAMPLES` and
  `MIN_DRAFT_ROWS` again, the wait doubling after each retry that lost (up to
  `DRAFT_PROBE_MAX_EVERY`). A bucket that cannot time
  both kinds within `EXPLORE_LIMIT` steps speculates for `PLAIN_PROBE_EVERY` steps, then tries
  again. Each change of a bucket's choice is logged;
- always (CPU engines, where wall-clock times describe nothing served, and DP replicas, whose
  steps wait for each other): every step speculates.

What a plain step costs the draft: it runs no draft pass, so the draft's KV misses its tokens
(a window draft forgets its window). Hence drafts are timed only from the `SETTLE` -th drafted
step in a row, the retries of drafts are longer than those of plain steps, and the scheduler
lets steps that compute prompt tokens speculate (their draft pass writes the prompt's draft
KV), whatever the bucket chose.

Plain steps are deferred like any engine's (async scheduling, where the engine has it: their
tokens stay on the device and the next step is scheduled before they land), so they are timed as
they run when the bucket chooses them. A step with drafts is never deferred, and drafts need the
newest tokens on the host: when drafts follow a deferred plain step, the scheduler first takes a
step that only lands its tokens (`Scheduler.num_landing_steps`).

A timed step is decode-only (each request computes its next token and its drafts) and of the
same kind and bucket as the step before it; its time is from the previous step's output to its
own (the loop's period, host work included), unless the loop paused (`MAX_GAP`).
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque

logger = logging.getLogger(__name__)

MIN_SAMPLES = 4            # timed steps of each kind before a bucket chooses
MIN_DRAFT_ROWS = 16        # ... and requests' verify steps among its drafted ones
SAMPLES = 8                # timed steps kept per bucket and kind (their periods)
ACCEPT_ROWS = 512          # requests' verify steps over which drafts' tokens are averaged
SETTLE = 4                 # drafted steps in a row before one is timed (the draft's KV refills)
PLAIN_PROBE_EVERY = 1000   # steps with drafts between two retries of plain steps
PLAIN_PROBE_STEPS = 3      # (the first is a switch, not timed)
DRAFT_PROBE_EVERY = 200    # plain steps between two retries of drafts (each: a landing step,
                           # a switch, SETTLE untimed, then until MIN_SAMPLES / MIN_DRAFT_ROWS)
DRAFT_PROBE_MAX_EVERY = 8 * DRAFT_PROBE_EVERY   # a retry that loses doubles the wait, up to this
MARGIN = 0.03              # a kind replaces the bucket's current one only when this much faster
Z_OFF = 1.5                # ... and drafts go off only when slower by this many standard errors
OFF_MIN_ROWS = 64          # ... over at least this many requests' verify steps (fewer can look
                           # steady when most keep no draft, and the error is then underrated)
EXPLORE_LIMIT = 64         # steps a bucket may spend timing both kinds
MAX_GAP = 0.05             # s between an output and the next step's schedule: longer = the loop paused


def measured_rule_applies(config, device_type: str) -> bool:
    """Whether an engine of `config` on `device_type` ranks picks the batches that speculate by
    measurement (the engine core's gate, and the worker's plain graphs at every size)."""
    return (config.speculative.enabled and config.speculative.disable_by_batch_size is None
            and device_type == "cuda" and config.parallel.data_parallel_size == 1)


def bucket_of(num_running: int) -> int:
    """Running requests rounded up to a power of two."""
    return 1 << max(0, num_running - 1).bit_length()


class _Bucket:
    def __init__(self):
        # per kind (drafts or not): (tokens emitted per request, period in s) of timed steps
        self.rates = {True: deque(maxlen=SAMPLES), False: deque(maxlen=SAMPLES)}
        # (tokens emitted, requests) of the timed drafted steps, the newest ACCEPT_ROWS
        # requests' worth (the oldest step dropped while the rest hold that many), and sums
        self.emitted: deque = deque()
        self.emitted_tokens = self.emitted_rows = 0
        self.choice: bool | None = None      # None: timing both kinds
        self.steps = 0                       # steps since exploring, the last change or retry began
        self.probe_left = 0                  # steps left in a retry of plain steps
        self.retrying: tuple | None = None   # a retry of drafts: the drafted samples before it
        self.hold = 0                        # steps to speculate before exploring again
        self.draft_every = DRAFT_PROBE_EVERY # plain steps between retries of drafts

    def add(self, drafts: bool, num_emitted: int, num_rows: int, period: float) -> None:
        self.rates[drafts].append((num_emitted / num_rows, period))
        if drafts:
            self.emitted.append((num_emitted, num_rows))
            self.emitted_tokens += num_emitted
            self.emitted_rows += num_rows
            while self.emitted_rows - self.emitted[0][1] >= ACCEPT_ROWS:
                tokens, rows = self.emitted.popleft()
                self.emitted_tokens -= tokens
                self.emitted_rows -= rows

    def start_draft_retry(self) -> None:
        """Time drafts anew (acceptance drifts with the traffic; samples from before the last
        plain period would outweigh a short retry's), keeping the old samples in case the
        retry cannot time any."""
        self.retrying = (self.rates[True], self.emitted, self.emitted_tokens, self.emitted_rows)
        self.rates[True], self.emitted = deque(maxlen=SAMPLES), deque()
        self.emitted_tokens = self.emitted_rows = 0

    def end_draft_retry(self) -> bool:
        """-> whether the retry timed enough drafted steps (else the old samples are back)."""
        old, self.retrying = self.retrying, None
        if self.drafts_ready():
            return True
        self.rates[True], self.emitted, self.emitted_tokens, self.emitted_rows = old
        return False

    def drafts_ready(self) -> bool:
        return len(self.rates[True]) >= MIN_SAMPLES and self.emitted_rows >= MIN_DRAFT_ROWS

    def ready(self) -> bool:
        return self.drafts_ready() and len(self.rates[False]) >= MIN_SAMPLES

    def parts(self, drafts: bool) -> tuple[float, float]:
        """(mean tokens per request, median period in s) of the kind's timed steps: the period
        over the last SAMPLES of them; drafts' tokens over the last ACCEPT_ROWS requests' verify
        steps (how many drafts a step keeps varies from step to step far more than its period;
        a short window, watched at every step, would sooner or later dip below the true mean
        and turn winning drafts off)."""
        samples = self.rates[drafts]
        period = statistics.median(p for _, p in samples)
        if drafts:
            return self.emitted_tokens / self.emitted_rows, period
        return statistics.fmean(t for t, _ in samples), period

    def rate(self, drafts: bool) -> float:
        """Tokens per request per second of the kind's timed steps."""
        tokens, period = self.parts(drafts)
        return tokens / period

    def drafts_rate_error(self) -> float:
        """Standard error of `rate(True)` from the spread of its tokens: the variance of one
        request's tokens is estimated from the steps' means (a step of n requests has a mean
        whose variance is sigma^2 / n)."""
        steps = len(self.emitted)
        if steps < 2:
            return float("inf")
        mean = self.emitted_tokens / self.emitted_rows
        var = sum(n * (t / n - mean) ** 2 for t, n in self.emitted) / (steps - 1)
        return (var / self.emitted_rows) ** 0.5 / self.parts(True)[1]


class SpeculationGate:
    """`speculate(...)` before each step; `scheduled(step)` once it is built; `observe(...)`
    with its result. `fixed`: disable_by_batch_size (None: not fixed); `measured`: the timed
    rule (else always). `clock`: seconds, monotonic."""

    def __init__(self, fixed: int | None = None, measured: bool = False, clock=time.monotonic):
        self.fixed, self.measured, self.clock = fixed, measured and fixed is None, clock
        self.buckets: dict[int, _Bucket] = {}
        self._on = True                          # the fixed rule's state, for its log lines
        # (step, when it was scheduled) of the steps whose output has not come yet, in order: a
        # plain step may be deferred (async scheduling), its output coming after the next step
        # was scheduled
        self._scheduled: deque = deque()
        self._last: tuple | None = None          # (timing key, output time) of the previous step
        self._drafted_run = 0                    # drafted steps in a row, up to the last one

    @property
    def rule(self) -> str:
        return "fixed" if self.fixed is not None else "measured" if self.measured else "always"

    def speculate(self, num_running: int, prompt_due=lambda: False) -> bool:
        """Whether the next step verifies drafts. `prompt_due()`: whether it may compute prompt
        tokens (asked only under the measured rule, which then speculates: the draft pass writes
        the prompt's draft KV whatever the bucket chose)."""
        if self.fixed is not None:
            on = num_running < self.fixed
            if on != self._on:
                logger.info("speculative decoding %s: %d requests running (disable_by_batch_size %d)",
                            "back on" if on else "off", num_running, self.fixed)
                self._on = on
            return on
        if not self.measured or num_running == 0:
            return True
        return self._measured_choice(num_running) or prompt_due()

    def _measured_choice(self, num_running: int) -> bool:
        b = bucket_of(num_running)
        state = self.buckets.setdefault(b, _Bucket())
        if state.hold:
            state.hold -= 1
            return True
        state.steps += 1
        if state.choice is None and not state.ready():      # exploring
            if state.steps > EXPLORE_LIMIT:      # too few steady decode steps here to time
                state.steps, state.hold = 0, PLAIN_PROBE_EVERY
                return True
            return not state.drafts_ready()      # drafts first, then plain steps
        if state.retrying is not None:           # a retry of drafts, until they are timed anew
            if not state.drafts_ready() and state.steps <= EXPLORE_LIMIT:
                return True
            # (none timed: plain steps stay) a retry that lost waits twice as long
            choice = self._decide(state, b) if state.end_draft_retry() else False
            state.steps = 0
            state.draft_every = DRAFT_PROBE_EVERY if choice else min(2 * state.draft_every, DRAFT_PROBE_MAX_EVERY)
            return choice
        if state.probe_left:                     # a retry of plain steps
            state.probe_left -= 1
            return False
        choice = self._decide(state, b)
        if state.steps >= (PLAIN_PROBE_EVERY if choice else state.draft_every):
            state.steps = 0
            if choice:
                state.probe_left = PLAIN_PROBE_STEPS
            else:
                state.start_draft_retry()
        return choice

    @staticmethod
    def _decide(state: _Bucket, b: int) -> bool:
        """The bucket's choice from its samples. The kind running now (drafts, before the first
        choice: a bucket starts with them) stays unless the other is faster by MARGIN -- every
        change costs steps no timed sample sees (a landing step, a switch step without real
        drafts, drafted steps while the draft's KV refills) -- and drafts go off only when
        plain steps are also faster by Z_OFF standard errors of the drafts' rate: a wrong off
        holds until a retry, a wrong on corrects itself as drafted steps are timed."""
        drafts, plain = state.rate(True), state.rate(False)
        current = state.choice is not False
        if current:
            change = (plain > drafts * (1 + MARGIN) and state.emitted_rows >= OFF_MIN_ROWS
                      and plain - drafts > Z_OFF * state.drafts_rate_error())
        else:
            change = drafts > plain * (1 + MARGIN)
        choice = current != change
        if choice != state.choice:
            state.choice, state.steps = choice, 0
        if change:                               # logged (keeping the drafts it starts with is not)
            span = f"{b // 2 + 1}-{b}" if b > 1 else "1"
            (dt, dp), (_, pp) = state.parts(True), state.parts(False)
            logger.info("speculative decoding %s for %s running requests (measured: %.1f tokens/s per "
                        "request with drafts (%.2f tokens per request every %.2f ms), %.1f without (every "
                        "%.2f ms))", "on" if choice else "off", span, drafts, dt, dp * 1e3, plain, pp * 1e3)
        return choice

    def scheduled(self, step) -> None:
        """`step` (a SchedulerOutput) was scheduled now."""
        if self.measured:
            self._scheduled.append((step, self.clock()))

    def observe(self, step, num_emitted: int, num_requests: int | None = None) -> None:
        """`step`'s output arrived (a SchedulerOutput): `num_emitted` tokens came out, for
        `num_requests` of its requests (None: every one)."""
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
        drafted = step.speculate and bool(spec)
        # (a step of stand-ins refills no draft KV for its requests: it does not count)
        self._drafted_run = self._drafted_run + 1 if drafted and not step.padded_drafts else 0
        # a step that asked for drafts and had none to verify (or only stand-ins, for some rows:
        # `SchedulerOutput.padded_drafts`) is a switch, of neither kind
        kind = drafted if step.speculate == drafted and not step.padded_drafts else None
        # timed: decode-only steps (every request computes its next token and its drafts only)
        decode_only = kind is not None and all(n == 1 + len(spec.get(r, ())) for r, n in rows.items())
        num_rows = len(rows)
        # a step is timed only after one of the same kind, bucket and deferral: a step that is
        # not deferred, after one that was, returns with that one's output (no period of its own)
        key = (kind, bucket_of(num_rows), deferred) if decode_only and num_rows else None
        last, self._last = self._last, (key, now)
        if key is None or last is None or last[0] != key or started is None or started - last[1] > MAX_GAP:
            return
        if drafted and self._drafted_run <= SETTLE:
            return
        if num_requests is not None and num_requests != num_rows:
            return                               # some rows emitted nothing (finished or aborted)
        period = now - last[1]
        if period > 0:
            self.buckets.setdefault(key[1], _Bucket()).add(kind, num_emitted, num_rows, period)
