"""Draft / verify / reject sequences against the scheduler and KV manager: a shadow-KV model
(tests/unit/test_scheduler.py's fake runner) verifies drafts that are partly right and partly
wrong, while a tiny pool forces preemptions, a small budget chunks prompts, and requests are
aborted at random. After every step the integrity check holds (no leaked or doubly held block
in any group, refcounts consistent); at the end every block is back and every finished request
produced exactly the reference tokens."""
import random
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_scheduler import FakeRunner, Run, next_token, reference, req  # noqa: E402

from m3serve.config import SchedulerConfig  # noqa: E402
from m3serve.core.kv_cache.manager import KVCacheManager  # noqa: E402
from m3serve.core.scheduler import Scheduler  # noqa: E402


class DraftingRunner(FakeRunner):
    """Proposes k drafts after every step: the true continuation, each token wrong with
    probability `p_wrong` (a wrong one, and everything after it, is rejected)."""

    def __init__(self, block_size, k, p_wrong, rng):
        super().__init__(block_size)
        self.k, self.p_wrong, self.rng = k, p_wrong, rng

    def execute(self, so):
        out = super().execute(so)
        spec = []
        for rid, sampled in zip(out.req_ids, out.sampled_token_ids):
            state = self.reqs[rid]
            context = state["tokens"] + list(sampled)
            drafts = []
            for _ in range(self.k):
                t = next_token(context + drafts)
                drafts.append((t + 1) % 97 if self.rng.random() < self.p_wrong else t)
            spec.append(drafts)
        out.spec_token_ids = spec
        return out


def _drive(run, rng, wanted: dict, max_steps: int, p_abort: float, check=lambda so: None) -> None:
    """Step until done (or max_steps), aborting a random running request with probability
    p_abort after each step; then every request not aborted produced `wanted`'s tokens."""
    sched, aborted = run.sched, set()
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        check(run.step())
        if rng.random() < p_abort and sched.running:
            victim = rng.choice(sched.running).request_id
            sched.abort_requests([victim])
            aborted.add(victim)
    run.close()
    for rid, tokens in wanted.items():
        if rid not in aborted:
            assert run.tokens[rid] == tokens, rid


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 4), p_wrong=st.sampled_from([0.0, 0.3, 0.8]),
       num_blocks=st.integers(12, 40), budget=st.sampled_from([7, 16, 64]))
def test_draft_verify_reject_keeps_the_books(seed, k, p_wrong, num_blocks, budget):
    rng = random.Random(seed)
    block_size = 4
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6), kv,
                      max_model_len=96, num_speculative_tokens=k)
    run = Run(sched, DraftingRunner(block_size, k, p_wrong, rng))
    shared = [rng.randrange(97) for _ in range(9)]
    wanted = {}
    for i in range(8):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(97) for _ in range(rng.randrange(1, 20))]
        max_tokens = rng.randrange(1, 14)
        sched.add_request(req(f"r{i}", prompt, max_tokens=max_tokens))
        wanted[f"r{i}"] = reference(prompt, max_tokens)
    _drive(run, rng, wanted, 400, 0.05)
    if p_wrong < 0.5:
        assert sched.spec_stats.num_accepted_tokens > 0


class PlainStepRunner(DraftingRunner):
    """As DraftingRunner, but a step the scheduler ran without speculation proposes nothing (the
    requests then have no drafts when drafts come back), and every draft a step verifies must
    be one this runner proposed after the request's previous step, in order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.proposed: dict[str, list[int]] = {}

    def execute(self, so):
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            assert drafts == self.proposed.get(rid, [])[:len(drafts)], (rid, drafts, "not proposed")
        out = super().execute(so)
        if so.speculate and not so.propose:       # the draft pass only wrote its KV
            out.spec_token_ids = [[] for _ in out.req_ids]
        # per request, what its last scheduled step proposed (a request the next step cannot
        # fit keeps its drafts for the step after)
        for rid, drafts in zip(out.req_ids, out.spec_token_ids):
            self.proposed[rid] = drafts if so.speculate else []
        if not so.speculate:
            out.spec_token_ids = None
        return out


class RandomWidths:
    """A gate that answers each step at random: plain (None), or verify 0..k drafts."""

    rule = "random"

    def __init__(self, k, rng):
        self.k, self.rng, self.widths = k, rng, []

    def draft_width(self, num_running, prompt_due=lambda: False, length=lambda: None, joining=None):
        self.widths.append(self.rng.choice([None, *range(self.k + 1)]))
        return self.widths[-1]

    def scheduled(self, step):
        pass

    def observe(self, step, num_requests=None, verified=()):
        pass


# The pools drawn hold the longest request (19 prompt + 23 output tokens): 11 blocks of 4 beside
# the null block; not always its k lookahead slots as well (its drafts stop where the pool ends).
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 4), num_blocks=st.integers(12, 40),
       budget=st.sampled_from([7, 16, 64]))
def test_switches_and_widths_keep_the_books(seed, k, num_blocks, budget):
    """Each step runs plain, only writes the draft's KV (the gate's 0: no proposals), or verifies
    the first j of each request's k drafts (the measured gate's arms, here at random), through
    preemptions, chunking, aborts and steps that cannot schedule a request: a step verifies at
    most j drafts of each request, each the one proposed after its previous step, every verified
    draft is counted once, and the books and the tokens stay exact."""
    rng = random.Random(seed)
    block_size = 4
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6), kv,
                      max_model_len=96, num_speculative_tokens=k)
    sched.spec_gate = gate = RandomWidths(k, rng)
    run = Run(sched, PlainStepRunner(block_size, k, 0.3, rng))
    wanted = {}
    for i in range(8):
        prompt = [rng.randrange(97) for _ in range(rng.randrange(1, 20))]
        max_tokens = rng.randrange(1, 24)
        sched.add_request(req(f"r{i}", prompt, max_tokens=max_tokens))
        wanted[f"r{i}"] = reference(prompt, max_tokens)
    verified = [0]

    def check(so):
        width = gate.widths[-1]
        assert so.speculate == (width is not None)
        assert so.propose == (width != 0)           # a gate's 0: plain arm, prompt due
        assert all(len(d) <= (width or 0) for d in so.scheduled_spec_decode_tokens.values())
        verified[0] += sum(1 for d in so.scheduled_spec_decode_tokens.values() if d)
    _drive(run, rng, wanted, 600, 0.03, check)
    assert sched.spec_stats.num_drafts == verified[0]
    assert sched.num_plain_steps == gate.widths.count(None)


def test_a_pool_that_holds_the_request_but_not_its_lookahead_does_not_stall():
    """Found by the test above with 12 blocks (11 usable, 44 tokens): after a preemption, r4 (41
    tokens, 40 of them a prefix hit) asked for its last token plus k = 4 lookahead slots, 12
    blocks; nothing else ran, so it was never admitted and the scheduler stalled with four
    requests waiting. Lookahead slots now stop where the pool ends, and so do the drafts a
    request verifies (as they stop at max_model_len): the server lets a request grow to the
    pool's size when the pool holds fewer tokens than max_model_len."""
    test_switches_and_widths_keep_the_books.hypothesis.inner_test(seed=1269, k=4, num_blocks=12, budget=7)
