"""The measured speculation gate on the real scheduler, driven through `bench offline`'s sequence
of one point (its warm-up, a prefill run, then the decode run whose peer TPOT is
reported) at batch 1, 4 and 16 on one engine, with step times from a cost model and synthetic
acceptance: the CPU twin of issue 49's measurement at one TP 8 rank (H100, online fp8 target).

Costs: a plain decode step 5.71 / 7.34 / 13.17 ms at batch 1 / 4 / 16 (the off engine's TPOT
there); a verify of all k drafts the measured peer TPOT x the acceptance (EAGLE3-GQA k 3 at
2.78: 3.44 / 5.58 / 9.76 ms per token; DSpark k 7 at 2.3: 4.30 / 9.42 / 14.20), of j < k drafts
plain + (that - plain) x sqrt(j / k), of none (a switch step) plain + 15 % of the difference;
a step that computes prompt tokens 30 ms + 25 us a token (+ 10 ms with the draft pass); a step
that only lands deferred tokens 0.1 ms. Batches pad to the capture sizes 1, 4, 16, 64."""
import random

import pytest

from m3serve.bench.offline import GATE_WARM_UP_TOKENS
from m3serve.config import SchedulerConfig
from m3serve.core.kv_cache.manager import KVCacheManager
from m3serve.core.request import Request
from m3serve.core.scheduler import Scheduler
from m3serve.core.scheduler_output import ModelRunnerOutput
from m3serve.sampling_params import SamplingParams
from m3serve.worker.rejection import synthetic_acceptance_rate

ISL, OSL, WARM = 1024, 128, GATE_WARM_UP_TOKENS
SIZES = (1, 4, 16, 64)
PLAIN_MS = {1: 5.71, 4: 7.34, 16: 13.17, 64: 19.4}
TPOT_MS = {"eagle3": (3, 2.78, {1: 3.44, 4: 5.58, 16: 9.76, 64: 17.0}),
           "dspark": (7, 2.3, {1: 4.30, 4: 9.42, 16: 14.20, 64: 26.0})}


def _at(table: dict[int, float], b: int) -> float:
    """table's value at batch b, linear between its batch sizes (b beyond them: the last)."""
    lo = max((s for s in table if s <= b), default=min(table))
    hi = min((s for s in table if s >= b), default=max(table))
    return table[lo] if hi == lo else table[lo] + (table[hi] - table[lo]) * (b - lo) / (hi - lo)


class SyntheticEngine:
    """The scheduler, a fake clock, and a runner that emits synthetic acceptance (each draft
    kept with one probability once the one before it was) and k drafts after each step that
    speculated; deferred steps' outputs come with the next step's, as in `EngineCore.execute`."""

    def __init__(self, kind: str | None, seed: int = 0, max_num_batched_tokens: int = 2 * ISL,
                 sizes: tuple[int, ...] | None = SIZES, prompt_s_per_token: float = 25e-6,
                 max_model_len: int = ISL + OSL + 256):
        """`sizes`: the capture sizes batches pad to (None: the cost is interpolated at the batch
        itself, between the table's batch sizes); `prompt_s_per_token`: a prompt step's cost per
        token computed."""
        self.sizes, self.prompt_s_per_token = sizes, prompt_s_per_token
        self.k, mean, self.tpot = TPOT_MS[kind] if kind else (0, 1.0, {})
        self.alpha = synthetic_acceptance_rate(mean, self.k) if kind else 0.0
        self.mean, self.rng, self.now, self.n = mean, random.Random(seed), 0.0, 0
        kv = KVCacheManager(4096, 128)
        self.sched = Scheduler(SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=64),
                               kv, max_model_len, num_speculative_tokens=self.k, async_scheduling=True,
                               measure_speculation=kind is not None)
        self.sched.spec_gate.clock = lambda: self.now
        self._deferred = None

    def _cost(self, so) -> float:
        if not so.total_num_scheduled_tokens:
            return 0.1e-3
        spec, rows = so.scheduled_spec_decode_tokens, so.num_scheduled_tokens
        widths = {len(spec.get(r, ())) for r in rows}
        if all(n == 1 + len(spec.get(r, ())) for r, n in rows.items()) and len(widths) == 1:
            b = len(rows) if self.sizes is None else next(s for s in self.sizes if s >= len(rows))
            plain = _at(PLAIN_MS, b) / 1e3
            if not so.speculate or not self.k:
                return plain
            j, full = widths.pop(), _at(self.tpot, b) * self.mean / 1e3
            return plain + (full - plain) * ((j / self.k) ** 0.5 if j else 0.15)
        return (0.03 + so.total_num_scheduled_tokens * self.prompt_s_per_token
                + (0.01 if so.speculate and self.k else 0))

    def _run(self, so) -> ModelRunnerOutput:
        self.now += self._cost(so)
        ids, sampled = list(so.num_scheduled_tokens), []
        for r in ids:
            kept = 0
            while kept < len(so.scheduled_spec_decode_tokens.get(r, ())) and self.rng.random() < self.alpha:
                kept += 1
            sampled.append([5] * (1 + kept))
        drafts = [[7] * self.k if so.speculate else [] for _ in ids] if self.k else None
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, spec_token_ids=drafts)

    def step(self) -> None:
        so = self.sched.schedule()
        out = self._run(so)
        if self._deferred is not None:
            self.sched.update_from_output(*self._deferred)
        self._deferred = (so, out) if so.deferred else None
        if not so.deferred:
            self.sched.update_from_output(so, out)

    def add(self, prompt_len: int, max_tokens: int) -> Request:
        """A new request of `prompt_len` random tokens to `max_tokens` output tokens."""
        self.n += 1
        prompt = [self.rng.randrange(10, 2000) for _ in range(prompt_len)]
        request = Request(f"r{self.n}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          eos_token_id=0)
        self.sched.add_request(request)
        return request

    def busy(self) -> bool:
        """Requests left, or a deferred step's output not yet applied."""
        return self.sched.has_unfinished_requests() or self._deferred is not None

    def generate(self, batch: int, max_tokens: int) -> float:
        """Seconds to run `batch` new requests of ISL random tokens to `max_tokens` each."""
        for _ in range(batch):
            self.add(ISL, max_tokens)
        start = self.now
        while self.busy():
            self.step()
        return self.now - start

    def point(self, batch: int) -> tuple[float, int, int]:
        """One point of `bench offline`: (peer TPOT in ms, plain steps, requests' verify steps of
        the measured runs)."""
        self.generate(batch, WARM)
        plain, verified = self.sched.num_plain_steps, self.sched.spec_stats.num_drafts
        prefill = self.generate(batch, 1)
        total = self.generate(batch, OSL + 1)
        return ((total - prefill) / OSL * 1e3, self.sched.num_plain_steps - plain,
                self.sched.spec_stats.num_drafts - verified)


@pytest.fixture(scope="module")
def off():
    engine = SyntheticEngine(None)
    return {b: engine.point(b)[0] for b in (1, 4, 16)}


@pytest.mark.parametrize("seed", range(4))
def test_dspark_at_batch_4_decodes_plainly_after_the_warm_up(off, seed):
    """Issue 49: DSpark k 7 at 2.3, whose verify steps are slower per token than plain steps at
    batch 4 and 16, ran drafted for all 208 of the batch-4 point's verify steps. Here the gate
    has chosen by the end of the point's warm-up: the measured decode runs plain steps, and its
    prompt steps too (their requests join a bucket that chose plain steps: no draft pass), so
    the peer TPOT is within 1 % of speculation off's at 4 and 2 % at 16 (all drafted: 22 %
    slower at 4; with the draft pass in the prompt steps it was up to 4 % slower here and 10 %
    at the rank); at batch 1, where drafts win, they stay on."""
    engine = SyntheticEngine("dspark", seed)
    tpot1, plain1, _ = engine.point(1)
    tpot4, plain4, verified4 = engine.point(4)
    tpot16, plain16, verified16 = engine.point(16)
    assert plain1 == 0 and tpot1 < off[1] / 1.15
    assert engine.sched.spec_gate.buckets[4].choice == 0 and engine.sched.spec_gate.buckets[16].choice == 0
    assert plain4 >= OSL and verified4 <= 4 and plain16 >= OSL and verified16 <= 16
    assert tpot4 <= off[4] * 1.01 and tpot16 <= off[16] * 1.02


@pytest.mark.parametrize("seed", range(2))
def test_eagle3_keeps_drafts_on_at_every_batch(off, seed):
    """EAGLE3-GQA k 3 at 2.78 wins at batch 1, 4 and 16 (1.66 / 1.31 / 1.35x as measured): the
    gate keeps all 3 drafts on in each measured decode, and each is faster than speculation off
    by more than 5 % (this cost model's prompt steps and the progress the requests' drafts
    spread at the end of a fixed batch take some of the measured speed-ups)."""
    engine = SyntheticEngine("eagle3", seed)
    for batch in (1, 4, 16):
        tpot, plain, verified = engine.point(batch)
        assert plain == 0 and verified > batch * OSL / 3.5, batch
        assert engine.sched.spec_gate.buckets[batch].choice == 3
        assert tpot < off[batch] / 1.05, batch
