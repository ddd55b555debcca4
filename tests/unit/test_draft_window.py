"""A window draft's own pool (DSpark; core/kv_cache/draft_window.py), driven through the
scheduler by a fake runner that keeps a shadow draft cache.

The runner applies each step's draft-table diff as the worker does, writes every computed
token's draft "KV" (its whole prefix) at the slot its draft table names (entry 0: the null
block, a sink), and after the step runs the draft's query block: it writes k keys past the last
verified position and reads every context key of the window from the valid position on, which
must hold exactly the verified prefix. A block released too early, reused while still read, a
hole read (KV a plain step never wrote included), or a stale prefix hit therefore fails. The draft pool must never hold more than a
window's blocks per request, and be whole after finish, preemption and abort.
"""
from m3serve.config import SchedulerConfig
from m3serve.core.kv_cache.specs import window_pool_blocks
from m3serve.core.kv_cache.manager import KVCacheManager
from m3serve.core.request import Request
from m3serve.core.scheduler import Scheduler
from m3serve.core.scheduler_output import ModelRunnerOutput
from m3serve.sampling_params import SamplingParams

VOCAB, BS, W, K = 97, 4, 12, 3
MAX_HELD = 5      # [lo, c' + k) is W + 2k - 1 = 17 tokens: at most 5 blocks of 4


def next_token(context):
    acc = 0
    for t in context:
        acc = (acc * 31 + t + 1) % 1_000_003
    return acc % VOCAB


class ShadowDraft:
    """The worker's view: draft tables from the diffs, a shadow draft cache, drafts proposed
    as the true continuation with every third one wrong."""

    def __init__(self):
        self.cache: dict[tuple[int, int], tuple] = {}
        self.reqs: dict[str, dict] = {}
        self.num_reads = 0
        self.num_steps = 0

    def _apply(self, state, update, clear=False):
        if clear:
            state.update(table={}, first=0, end=0, valid_from=0)
        if update is None:
            return
        for b in range(state["first"], min(update.first_block, state["end"])):
            state["table"].pop(b, None)
        if update.first_block > state["first"]:
            state["first"] = update.first_block
            state["end"] = max(state["end"], update.first_block)
        for i, block_id in enumerate(update.new_block_ids):
            state["table"][state["end"] + i] = block_id
        state["end"] += len(update.new_block_ids)
        state["valid_from"] = update.valid_from

    def _slot(self, state, pos):
        return state["table"].get(pos // BS, 0), pos % BS

    def execute(self, so):
        self.num_steps += 1
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for rid in so.preempted_req_ids:
            self._apply(self.reqs[rid], None, clear=True)
        for new in so.scheduled_new_reqs:
            state = dict(tokens=list(new.prompt_token_ids), computed=new.num_computed_tokens)
            self._apply(state, new.draft_blocks, clear=True)
            self.reqs[new.req_id] = state
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            state = self.reqs[rid]
            state["tokens"].extend(c.new_token_ids[i])
            self._apply(state, c.draft_blocks[i], clear=c.resumed_from_preemption[i])
            state["computed"] = c.num_computed_tokens[i]
        sampled, proposals = [], []
        for rid, n in so.num_scheduled_tokens.items():
            state = self.reqs[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            seq = state["tokens"] + drafts
            start = state["computed"]
            state["computed"] = start + n
            if not so.speculate:                                # a plain step: no draft pass
                sampled.append([next_token(seq[:start + n])])
                continue
            for pos in range(start, start + n):                 # the first pass: context rows
                block, off = self._slot(state, pos)
                if block:
                    self.cache[block, off] = tuple(seq[:pos + 1])
            if start + n >= len(state["tokens"]):
                verified = list(state["tokens"])
                for d in drafts:
                    if d != next_token(verified):
                        break
                    verified.append(d)
                emitted = verified[len(state["tokens"]):] + [next_token(verified)]
            else:                                               # a partial prompt chunk
                verified, emitted = seq[:start + n], [0]
            p = len(verified) - 1
            self._query(state, verified, p)
            truth = verified + [emitted[-1]] if start + n >= len(state["tokens"]) else verified
            guess = [next_token(truth)]
            for j in range(1, K):
                guess.append((next_token(truth + guess) + (j == 2 and self.num_steps % 3 == 0)) % VOCAB)
            sampled.append(emitted)
            proposals.append(guess)
        return ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=sampled,
                                 spec_token_ids=proposals if so.speculate else None)

    def _query(self, state, verified, p):
        """The query block at p + 1 .. p + k: its own keys, then every window key read."""
        for pos in range(p + 1, p + 1 + K):
            block, off = self._slot(state, pos)
            assert block, f"query position {pos} has no draft block"
            self.cache[block, off] = ("query", pos)
        for q in range(p + 1, p + 1 + K):
            for pos in range(max(q - W + 1, state["valid_from"], 0), p + 1):
                block, off = self._slot(state, pos)
                assert block, f"key {pos} of the window (query {q}) has no draft block"
                assert self.cache.get((block, off)) == tuple(verified[:pos + 1]), f"key {pos} is stale"
                self.num_reads += 1


def make(num_blocks=64, max_seqs=4, max_batched=32, disable_by_batch_size=None):
    draft_blocks = window_pool_blocks(W, K, BS, max_seqs, 256)
    kv = KVCacheManager(num_blocks, BS, draft_window=W, num_draft_blocks=draft_blocks, num_lookahead_tokens=K)
    cfg = SchedulerConfig(max_num_batched_tokens=max_batched, max_num_seqs=max_seqs,
                          long_prefill_token_threshold=0)
    return Scheduler(cfg, kv, max_model_len=256, num_speculative_tokens=K,
                     disable_spec_by_batch_size=disable_by_batch_size)


def req(rid, prompt, max_tokens):
    return Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), None)


def run(sched, runner, max_steps=2000, on_step=None):
    outputs = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not sched.has_finished_requests():
            break
        so = sched.schedule()
        for out in sched.update_from_output(so, runner.execute(so)):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        sched.check_integrity()
        draft = sched.kv_manager.draft
        for rid in draft.request_ids:
            assert len(draft.get_block_ids(rid)) <= MAX_HELD
        if on_step is not None:
            on_step(sched)
    return outputs


def reference(prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def assert_whole(sched):
    sched.check_integrity()
    draft = sched.kv_manager.draft
    assert draft.request_ids == []
    assert draft.num_free_blocks == draft.pool.num_usable_blocks


def test_a_long_generation_holds_only_its_window():
    sched, runner = make(), ShadowDraft()
    prompt = [(7 * i) % VOCAB for i in range(30)]
    held = []
    sched.add_request(req("a", prompt, 200))
    out = run(sched, runner, on_step=lambda s: held.append(len(s.kv_manager.draft.get_block_ids("a"))))
    assert out["a"] == reference(prompt, 200)
    assert max(held) <= MAX_HELD and len(prompt) + 200 > 10 * MAX_HELD * BS   # the context is far longer
    assert sched.spec_stats.num_accepted_tokens > 0 and runner.num_reads > 1000
    assert_whole(sched)


def test_preemption_abort_and_finish_leak_no_draft_block():
    sched, runner = make(num_blocks=24), ShadowDraft()         # too few target blocks: preemption
    prompts = {f"r{i}": [(i * 13 + j * 5) % VOCAB for j in range(9 + 6 * i)] for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, 40))
    aborted = []

    def abort_one(s):
        if s.num_preemptions and not aborted and "r5" in s.requests:
            s.abort_requests(["r5"])
            aborted.append("r5")
    out = run(sched, runner, on_step=abort_one)
    assert sched.num_preemptions > 0 and aborted
    for rid, prompt in prompts.items():
        if rid not in aborted:
            assert out[rid] == reference(prompt, 40), rid
    assert_whole(sched)


def test_a_prefix_hit_finds_the_window_of_its_last_blocks():
    sched, runner = make(), ShadowDraft()
    shared = [(11 * i + 3) % VOCAB for i in range(41)]
    sched.add_request(req("a", shared, 4))
    run(sched, runner)
    assert sched.kv_manager.draft.num_hit_blocks == 0
    sched.add_request(req("b", shared + [1, 2, 3], 20))
    out = run(sched, runner)
    assert sched.kv_manager.prefix_cache_hits > 0
    assert sched.kv_manager.draft.num_hit_blocks > 0           # read back by the shadow queries
    assert out["b"] == reference(shared + [1, 2, 3], 20)
    assert_whole(sched)


def test_tokens_of_plain_steps_are_holes_the_draft_never_reads():
    """disable_by_batch_size: while two requests run, steps decode without the draft (no draft
    KV written); the one left speculates again and must not read what those steps computed."""
    sched, runner = make(disable_by_batch_size=2), ShadowDraft()
    prompts = {"long": [(5 * i + 1) % VOCAB for i in range(20)], "short": [(3 * i) % VOCAB for i in range(7)]}
    sched.add_request(req("long", prompts["long"], 60))
    sched.add_request(req("short", prompts["short"], 10))
    out = run(sched, runner)
    assert sched.num_plain_steps > 5 and sched.spec_stats.num_drafts > 5 and runner.num_reads > 0
    assert out == {rid: reference(p, 60 if rid == "long" else 10) for rid, p in prompts.items()}
    assert_whole(sched)
