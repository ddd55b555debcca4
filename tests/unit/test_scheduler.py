"""Scheduler driven by a fake model runner that keeps a shadow KV cache.

The fake runner applies each SchedulerOutput as a diff (exactly as the real worker must), writes
the scheduled tokens into the slots named by the block ids, then reads the whole context back
through the block table to pick the next token. Any wrong block id, stale prefix hit or lost
token therefore changes the generated tokens, which are compared with a plain reference loop.
"""
import functools
from collections import defaultdict

import pytest

from m3serve.config import SchedulerConfig
from m3serve.core.kv_cache.manager import KVCacheManager, cdiv
from m3serve.core.request import Request, RequestStatus
from m3serve.core.scheduler import Scheduler
from m3serve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from m3serve.sampling_params import SamplingParams

VOCAB = 97


# the real sampling params; the scheduler reads max_tokens, min_tokens, stop_token_ids, ignore_eos
Params = functools.partial(SamplingParams, max_tokens=8)


def next_token(context):
    acc = 0
    for t in context:
        acc = (acc * 31 + t + 1) % 1_000_003
    return acc % VOCAB


def reference(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeRunner:
    """Applies SchedulerOutput diffs to per-request state and 'runs' a shadow-KV model."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.cache: dict[int, list] = {}
        self.reqs: dict[str, dict] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.reqs[rid]["blocks"] = None
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs
            self.reqs[new.req_id] = dict(tokens=list(new.prompt_token_ids), blocks=list(new.block_ids),
                                         computed=new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.reqs[rid]
            state["tokens"].extend(cached.new_token_ids[i])
            if cached.resumed_from_preemption[i]:
                assert state["blocks"] is None
                state["blocks"] = list(cached.new_block_ids[i])
            else:
                # The worker's own bookkeeping must agree with the scheduler's.
                assert state["computed"] == cached.num_computed_tokens[i], rid
                state["blocks"].extend(cached.new_block_ids[i] or [])
            state["computed"] = cached.num_computed_tokens[i]

        bs = self.block_size
        work = []
        for rid, n in so.num_scheduled_tokens.items():
            state = self.reqs[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            tokens = state["tokens"] + drafts
            start = state["computed"]
            assert start + n <= len(tokens), (rid, start, n, len(tokens))
            assert len(state["blocks"]) >= cdiv(start + n, bs)
            others = {b for r, s in self.reqs.items() if r != rid and s["blocks"] for b in s["blocks"]}
            for pos in range(start, start + n):
                block_id = state["blocks"][pos // bs]
                assert block_id not in others, f"{rid} writes block {block_id} shared with others"
                self.cache.setdefault(block_id, [None] * bs)[pos % bs] = tokens[pos]
            work.append((rid, start, n, drafts))

        req_ids, sampled = [], []
        for rid, start, n, drafts in work:
            state = self.reqs[rid]
            read = lambda p: self.cache[state["blocks"][p // bs]][p % bs]  # noqa: E731
            context = [read(p) for p in range(start + n)]
            assert None not in context
            if not drafts:
                out = [next_token(context)]
            else:  # verify: accept drafts while they match, then one bonus/correction token
                first = start + n - len(drafts)
                out = []
                for j in range(len(drafts) + 1):
                    out.append(next_token(context[:first + j]))
                    if j < len(drafts) and out[-1] != drafts[j]:
                        break
            state["computed"] = start + n - (len(drafts) + 1 - len(out))
            req_ids.append(rid)
            sampled.append(out)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def make(num_blocks=64, block_size=4, max_batched=64, max_seqs=16, max_model_len=256, caching=True,
         long_prefill=0, partial_prefills=0):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=max_batched, max_num_seqs=max_seqs,
                                      long_prefill_token_threshold=long_prefill,
                                      max_num_partial_prefills=partial_prefills), kv, max_model_len)
    return sched, FakeRunner(block_size)


def req(rid, prompt, eos=None, **params):
    return Request(rid, list(prompt), Params(**params), eos_token_id=eos)


class Run:
    def __init__(self, sched, runner):
        self.sched, self.runner = sched, runner
        self.tokens = defaultdict(list)
        self.finish = {}
        self.outputs = []
        self.steps: list[SchedulerOutput] = []

    def step(self):
        sched = self.sched
        so = sched.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert sched.num_running <= sched.config.max_num_seqs
        mro = self.runner.execute(so)
        for out in sched.update_from_output(so, mro):
            assert out.request_id not in self.finish
            self.tokens[out.request_id] += out.new_token_ids
            self.outputs.append(out)
            if out.finish_reason is not None:
                self.finish[out.request_id] = (out.finish_reason, out.stop_reason)
        sched.check_integrity()
        self.steps.append(so)
        return so

    def until_done(self, max_steps=1000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        else:
            raise AssertionError("scheduler did not finish")
        self.close()

    def close(self):
        """Flush finished ids to the runner; then nothing may be left anywhere."""
        so = self.sched.schedule()
        assert so.total_num_scheduled_tokens == 0
        self.runner.execute(so)
        assert self.runner.reqs == {}
        assert not self.sched.has_finished_requests()
        assert_pool_idle(self.sched)


def assert_pool_idle(sched):
    sched.check_integrity()
    kv = sched.kv_manager
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    assert kv.request_ids == []


def test_single_request_matches_reference():
    sched, runner = make()
    sched.add_request(req("a", [5, 6, 7, 8, 9, 10], max_tokens=10))
    run = Run(sched, runner)
    run.until_done()
    assert run.tokens["a"] == reference([5, 6, 7, 8, 9, 10], 10)
    assert run.finish["a"] == ("length", None)
    assert len(run.steps) == 10  # one prefill step, then one token per step


def test_chunked_prefill_under_small_budget():
    sched, runner = make(max_batched=8)
    prompt = list(range(1, 21))  # 20 tokens -> chunks 8, 8, 4
    sched.add_request(req("a", prompt, max_tokens=3))
    run = Run(sched, runner)
    scheduled = []
    while sched.has_unfinished_requests():
        so = run.step()
        scheduled.append(so.num_scheduled_tokens["a"])
        if len(scheduled) < 3:
            assert run.tokens["a"] == []  # partial prefill: the sampled token is discarded
    run.close()
    assert scheduled == [8, 8, 4, 1, 1]
    assert run.tokens["a"] == reference(prompt, 3)
    # The first chunk arrived as a new request, the next chunks as cached ones.
    assert [len(s.scheduled_new_reqs) for s in run.steps] == [1, 0, 0, 0, 0]


def test_budget_shared_between_decodes_and_a_prefill_chunk():
    sched, runner = make(max_batched=6)
    sched.add_request(req("a", [1, 2], max_tokens=6))
    sched.add_request(req("b", [3, 4], max_tokens=6))
    run = Run(sched, runner)
    run.step()  # both prefills fit: 2 + 2
    sched.add_request(req("c", list(range(10, 20)), max_tokens=2))
    so = run.step()
    # Running requests decode first (1 + 1), the new prompt gets the remaining 4 tokens.
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 4}
    run.until_done()
    assert run.tokens["c"] == reference(range(10, 20), 2)
    assert run.tokens["a"] == reference([1, 2], 6)


def test_long_prefill_token_threshold_chunks_long_prompts_beside_decodes():
    sched, runner = make(max_batched=64, long_prefill=8)
    sched.add_request(req("a", [1, 2], max_tokens=8))
    run = Run(sched, runner)
    run.step()
    sched.add_request(req("long", list(range(10, 40)), max_tokens=2))     # 30 prompt tokens
    chunks = []
    while "long" not in run.tokens or not run.tokens["long"]:
        so = run.step()
        assert so.num_scheduled_tokens.get("a", 1) == 1           # the decode runs every step
        chunks.append(so.num_scheduled_tokens.get("long", 0))
    assert chunks[:4] == [8, 8, 8, 6]          # the budget had room for all 30 at once
    run.until_done()
    assert run.tokens["long"] == reference(range(10, 40), 2) and run.tokens["a"] == reference([1, 2], 8)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("max_num_seqs", -5),
                                         ("max_num_batched_tokens", 0),
                                         ("max_num_partial_prefills", -1)])
def test_scheduler_config_refuses_bad_sizes(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_partial_prefills_without_threshold_cap_each_request_at_4_percent_of_max_model_len():
    """vLLM's default for the pair of flags: --max-num-partial-prefills > 1 and no
    --long-prefill-token-threshold chunk each prompt at int(0.04 x max_model_len) tokens per step
    (256 -> 10); one partial prefill, or an explicit threshold, keeps the flag's meaning."""
    for partial, threshold, want in ((2, 0, 10), (1, 0, 40), (0, 0, 40), (2, 6, 6)):
        sched, runner = make(max_batched=64, max_model_len=256, long_prefill=threshold,
                             partial_prefills=partial)
        assert sched.config.effective_long_prefill_threshold(256) == (want if want < 40 else 0)
        sched.add_request(req("p", list(range(40)), max_tokens=1))
        so = Run(sched, runner).step()
        assert so.num_scheduled_tokens["p"] == want


def test_max_num_partial_prefills_caps_prefilling_requests_per_step():
    """Two at a time: a third prompt waits although the budget has room, decodes never wait."""
    sched, runner = make(max_batched=64, long_prefill=4, partial_prefills=2)
    sched.add_request(req("a", [1, 2], max_tokens=12))
    run = Run(sched, runner)
    run.step()
    for name, start in (("p", 10), ("q", 30), ("r", 50)):
        sched.add_request(req(name, list(range(start, start + 12)), max_tokens=2))
    seen = []
    while not all(run.tokens.get(n) for n in "pqr"):
        so = run.step()
        assert so.num_scheduled_tokens.get("a", 1) == 1
        prefilling = [n for n in "pqr" if so.num_scheduled_tokens.get(n, 0) > 1]
        assert len(prefilling) <= 2
        seen.append(prefilling)
    assert seen[0] == ["p", "q"] and "r" in seen[3]          # r starts once p or q is done
    run.until_done()
    for name, start in (("p", 10), ("q", 30), ("r", 50)):
        assert run.tokens[name] == reference(range(start, start + 12), 2)
    assert run.tokens["a"] == reference([1, 2], 12)
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=-1)


def test_max_num_seqs_limits_running():
    sched, runner = make(max_seqs=2)
    prompts = {f"r{i}": [i + 1] * (3 + i) for i in range(5)}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_tokens=4))
    run = Run(sched, runner)
    run.step()
    assert sched.num_running == 2 and sched.num_waiting == 3
    run.until_done()
    assert max(len(s.num_scheduled_tokens) for s in run.steps) == 2
    for rid, prompt in prompts.items():
        assert run.tokens[rid] == reference(prompt, 4)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_recomputes_to_the_same_tokens(caching):
    # 9 usable blocks of 4 tokens; each request needs ceil((6 + 12 - 1) / 4) = 5 blocks at the end.
    sched, runner = make(num_blocks=10, caching=caching)
    prompts = {f"r{i}": [10 * i + j for j in range(6)] for i in range(4)}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_tokens=12))
    run = Run(sched, runner)
    run.until_done()
    assert any(s.preempted_req_ids for s in run.steps)
    # The most recently admitted request is the victim, never the oldest.
    first_victims = next(s.preempted_req_ids for s in run.steps if s.preempted_req_ids)
    assert "r0" not in first_victims
    resumed = {rid for s in run.steps
               for rid, is_resumed in zip(s.scheduled_cached_reqs.req_ids,
                                          s.scheduled_cached_reqs.resumed_from_preemption)
               if is_resumed}
    preempted = set().union(*(s.preempted_req_ids for s in run.steps))
    assert resumed == preempted  # every victim came back through the resume path
    for rid, prompt in prompts.items():
        assert run.tokens[rid] == reference(prompt, 12), rid
        assert run.finish[rid] == ("length", None)


def test_preempted_request_keeps_fifo_priority():
    sched, runner = make(num_blocks=5)  # 4 usable blocks
    sched.add_request(req("a", [1, 2, 3], max_tokens=12))  # needs 4 blocks by the end
    sched.add_request(req("b", [4, 5, 6], max_tokens=8))  # needs 3 blocks by the end
    run = Run(sched, runner)
    while not any(s.preempted_req_ids for s in run.steps):
        assert len(run.steps) < 20, "expected a preemption"
        run.step()
    assert run.steps[-1].preempted_req_ids == {"b"}
    assert sched.waiting[0].request_id == "b"
    assert sched.waiting[0].status == RequestStatus.PREEMPTED
    assert sched.waiting[0].num_computed_tokens == 0
    run.until_done()
    assert run.tokens["a"] == reference([1, 2, 3], 12)
    assert run.tokens["b"] == reference([4, 5, 6], 8)
    assert sched_request_preemptions(run, "b") == 1


def test_prefix_cache_hits_are_counted_and_correct():
    sched, runner = make(block_size=4)
    kv = sched.kv_manager
    prompt = list(range(30, 47))  # 17 tokens = 4 full blocks + 1
    sched.add_request(req("a", prompt, max_tokens=7))
    run = Run(sched, runner)
    run.until_done()
    assert kv.prefix_cache_hits == 0 and kv.prefix_cache_queries == 17

    sched.add_request(req("b", prompt[:16] + [1, 2], max_tokens=3))
    so = run.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {"b": 2}
    run.until_done()
    assert kv.prefix_cache_hits == 16
    assert run.tokens["b"] == reference(prompt[:16] + [1, 2], 3)
    assert [o.num_cached_tokens for o in run.outputs if o.request_id == "b"][0] == 16

    # Generated tokens are cached too: a's prompt + outputs (24 tokens) hits 5 full blocks.
    continued = prompt + run.tokens["a"]
    sched.add_request(req("c", continued, max_tokens=2))
    so = run.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20
    run.until_done()
    assert run.tokens["c"] == reference(continued, 2)

    # A prompt that is exactly cached still recomputes its last block's final token.
    sched.add_request(req("d", prompt[:16], max_tokens=1))
    so = run.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12 and so.num_scheduled_tokens == {"d": 4}
    run.until_done()
    assert run.tokens["d"] == reference(prompt[:16], 1)


def test_concurrent_requests_share_a_prefix():
    sched, runner = make(block_size=4, max_batched=12)
    shared = list(range(50, 62))  # 3 blocks
    sched.add_request(req("a", shared + [1], max_tokens=5))
    run = Run(sched, runner)
    run.step()  # a: 12 of 13 tokens, its 3 shared blocks get cached
    sched.add_request(req("b", shared + [2], max_tokens=5))
    so = run.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert sched.kv_manager.get_block_ids("a")[:3] == sched.kv_manager.get_block_ids("b")[:3]
    run.until_done()
    assert run.tokens["a"] == reference(shared + [1], 5)
    assert run.tokens["b"] == reference(shared + [2], 5)


def test_abort_waiting_midprefill_and_decoding():
    sched, runner = make(max_batched=8, max_seqs=2)
    sched.add_request(req("dec", [1, 2, 3], max_tokens=20))
    sched.add_request(req("pre", list(range(100, 120)), max_tokens=5))
    sched.add_request(req("wait", [7, 8], max_tokens=5))
    sched.add_request(req("ok", [9, 9, 9], max_tokens=4))
    run = Run(sched, runner)
    run.step()
    run.step()
    pre = sched.requests["pre"]
    assert 0 < pre.num_computed_tokens < pre.num_tokens  # mid-prefill
    assert run.tokens["dec"]  # decoding
    assert sched.requests["wait"].status == RequestStatus.WAITING
    free_before = sched.kv_manager.num_free_blocks
    sched.abort_requests(["wait", "pre", "dec", "unknown-id"])
    assert sched.kv_manager.num_free_blocks > free_before
    assert "dec" not in sched.requests and sched.get_num_unfinished_requests() == 1
    sched.check_integrity()
    so = run.step()
    assert {"wait", "pre", "dec"} <= so.finished_req_ids
    assert list(so.num_scheduled_tokens) == ["ok"]
    run.until_done()
    assert run.tokens["ok"] == reference([9, 9, 9], 4)
    assert "dec" not in run.finish and "pre" not in run.finish


def test_abort_between_schedule_and_update_drops_the_sample():
    sched, runner = make()
    sched.add_request(req("a", [1, 2, 3], max_tokens=5))
    sched.add_request(req("b", [4, 5, 6], max_tokens=2))
    run = Run(sched, runner)
    so = sched.schedule()
    mro = runner.execute(so)
    sched.abort_requests("a")
    outs = sched.update_from_output(so, mro)
    assert [o.request_id for o in outs] == ["b"]
    assert outs[0].new_token_ids == reference([4, 5, 6], 1)
    run.tokens["b"] += outs[0].new_token_ids
    sched.check_integrity()
    run.until_done()
    assert run.tokens["b"] == reference([4, 5, 6], 2)


def sched_request_preemptions(run, rid):
    return sum(rid in s.preempted_req_ids for s in run.steps)


def first_new(tokens, k):
    """Index >= k of the first generated token not seen before it (so it stops exactly there)."""
    return next(i for i in range(k, len(tokens)) if tokens[i] not in tokens[:i])


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def run_one(request, max_model_len=256):
    sched, runner = make(max_model_len=max_model_len)
    sched.add_request(request)
    run = Run(sched, runner)
    run.until_done()
    return run.tokens[request.request_id], run.finish[request.request_id]


def test_stop_on_eos():
    ref = reference(PROMPT, 30)
    k = first_new(ref, 2)
    tokens, finish = run_one(req("a", PROMPT, eos=ref[k], max_tokens=30))
    assert tokens == ref[:k + 1] and finish == ("stop", None)


def test_ignore_eos_and_min_tokens():
    ref = reference(PROMPT, 30)
    k = first_new(ref, 2)
    tokens, finish = run_one(req("a", PROMPT, eos=ref[k], max_tokens=30, ignore_eos=True))
    assert tokens == ref and finish == ("length", None)
    # min_tokens past the EOS position: EOS is ignored until then.
    tokens, finish = run_one(req("b", PROMPT, eos=ref[k], max_tokens=30, min_tokens=k + 2))
    later = [i for i in range(k + 1, 30) if ref[i] == ref[k] and i + 1 >= k + 2]
    assert len(tokens) == (later[0] + 1 if later else 30)
    assert len(tokens) > k + 1


def test_stop_token_ids_set_stop_reason():
    ref = reference(PROMPT, 30)
    k = first_new(ref, 3)
    tokens, finish = run_one(req("a", PROMPT, max_tokens=30, stop_token_ids=[ref[k], 1000]))
    assert tokens == ref[:k + 1] and finish == ("stop", ref[k])
    tokens, finish = run_one(req("b", PROMPT, max_tokens=30, stop_token_ids=[ref[k]],
                                 min_tokens=30))
    assert tokens == ref and finish == ("length", None)


def test_max_model_len_ends_with_length():
    tokens, finish = run_one(req("a", PROMPT, max_tokens=100), max_model_len=12)
    assert len(PROMPT) + len(tokens) == 12 and finish == ("length", None)
    assert tokens == reference(PROMPT, 4)
    # max_tokens None: generate until max_model_len.
    tokens, finish = run_one(req("b", PROMPT, max_tokens=None), max_model_len=13)
    assert tokens == reference(PROMPT, 5) and finish == ("length", None)


def test_engine_eos_ids_stop_without_stop_reason():
    ref = reference(PROMPT, 30)
    k = first_new(ref, 2)
    request = req("a", PROMPT, max_tokens=30)
    request.sampling_params.all_stop_token_ids = {ref[k]}
    tokens, finish = run_one(request)
    assert tokens == ref[:k + 1] and finish == ("stop", None)


def test_rejects_impossible_requests():
    sched, _ = make(num_blocks=5, block_size=4, max_model_len=64)  # 4 usable blocks = 16 tokens
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        sched.add_request(req("e", []))
    with pytest.raises(ValueError, match="prompt length 64 .* max_model_len 64"):
        sched.add_request(req("long", [1] * 64))
    with pytest.raises(ValueError, match="need 5 blocks .* only 4 blocks"):
        sched.add_request(req("big", [1] * 10, max_tokens=8))  # 17 tokens of KV
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        sched.add_request(req("zero", [1], max_tokens=0))
    sched.add_request(req("fits", [1] * 10, max_tokens=7))  # exactly 16 tokens of KV
    with pytest.raises(ValueError, match="already in the scheduler"):
        sched.add_request(req("fits", [2]))
    assert sched.get_num_unfinished_requests() == 1
    run = Run(sched, FakeRunner(4))
    run.until_done()
    assert run.tokens["fits"] == reference([1] * 10, 7)


def test_draft_tokens_verified_and_rolled_back():
    sched, runner = make()
    prompt = [2, 7, 1, 8]
    ref = reference(prompt, 12)
    sched.add_request(req("a", prompt, max_tokens=12))
    run = Run(sched, runner)
    run.step()  # prefill, first token
    request = sched.requests["a"]
    drafts = [ref[1], ref[2], (ref[3] + 1) % VOCAB]  # two right, one wrong
    request.spec_token_ids = list(drafts)
    so = run.step()
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": drafts}
    assert run.tokens["a"] == ref[:4]  # 2 accepted drafts + the correction token
    assert request.num_computed_tokens == request.num_tokens - 1
    request.spec_token_ids = [(ref[4] + 1) % VOCAB]  # rejected at once
    run.step()
    assert run.tokens["a"] == ref[:5]
    run.until_done()
    assert run.tokens["a"] == ref


def test_outputs_are_the_records_the_engine_process_sends():
    """One record for engine outputs: the scheduler emits the protocol's `CoreOutput`, which the
    engine process sends as it is (no field-by-field copy a new field could miss); every field
    survives the wire."""
    import msgspec

    from m3serve import protocol

    sched, runner = make()
    sched.add_request(req("a", [5, 6, 7], max_tokens=2))
    run = Run(sched, runner)
    run.until_done()
    assert run.outputs and all(isinstance(o, protocol.CoreOutput) for o in run.outputs)
    last = run.outputs[-1]
    last.kv_transfer_params, last.error_is_client = {"remote_block_ids": [1]}, True
    back = protocol.decode_output(protocol.encode(protocol.CoreOutputs(outputs=[last]))).outputs[0]
    assert msgspec.structs.asdict(back) == msgspec.structs.asdict(last)
