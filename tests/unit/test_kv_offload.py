"""The CPU tier's books: LRU slots, and the two tiers' block accounting under random admit /
compute / finish / preempt / restore / abort sequences against a fake worker whose copies land
late (any time between their batch being sent and its completion being reported)."""
import functools
from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_scheduler import FakeRunner, reference  # tests/unit is on the path

from m3serve.config import SchedulerConfig
from m3serve.core.kv_cache.cpu_tier import CPUBlockTier
from m3serve.core.kv_cache.manager import KVCacheManager
from m3serve.core.request import Request, RequestStatus
from m3serve.core.scheduler import Scheduler
from m3serve.core.kv_cache.offload import CPUTierConnector
from m3serve.core.scheduler_output import KVOffloadReport
from m3serve.sampling_params import SamplingParams

Params = functools.partial(SamplingParams, max_tokens=16)
H = [bytes([i]) * 32 for i in range(10)]


def test_cpu_tier_evicts_least_recent_unpinned_slot():
    tier = CPUBlockTier(3)
    a, b, c = (tier.store_slot(h) for h in H[:3])
    assert tier.store_slot(H[0]) is None             # held already: no second copy
    assert tier.store_slot(H[3]) is None             # every slot pinned by its store in flight
    tier.unpin([a, b, c])
    assert tier.lookup([H[0]]) == [a]                # a is now the most recent
    tier.pin([b])                                    # a copy out of b is in flight
    d = tier.store_slot(H[3])
    assert d == c and H[2] not in tier and tier.num_evictions == 1
    tier.unpin([d])
    assert tier.store_slot(H[4]) == a                # b is pinned, so a (then d) go first
    assert tier.lookup([H[1], H[3], H[0]]) == [b, d]
    assert tier.check_integrity() == []
    tier.unpin([b])
    with pytest.raises(RuntimeError, match="unpinned more often"):
        tier.unpin([b])


def test_cpu_tier_integrity_names_a_missing_pin():
    tier = CPUBlockTier(2)
    slot = tier.store_slot(H[0])
    assert tier.check_integrity({slot: 1}) == []
    assert "1 pins, but 0 copies use it" in tier.check_integrity({})[0]


BS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23, 24, 25, 26, 27]]


class TwoTierMachine(RuleBasedStateMachine):
    """A shadow of every GPU page and CPU slot (the tokens it holds) checks that a prefix hit,
    in either tier, brings back exactly the request's tokens: a copy that read a page after it
    was reused, or wrote one still in use, shows up as wrong tokens."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=10, block_size=BS, num_cpu_blocks=5)
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.live: dict[str, Request] = {}
        self.loading: dict[str, tuple[Request, int, bool]] = {}   # request, tokens once loaded, aborted
        self.sent: deque = deque()           # batches sent, not reported done
        self.applied = 0                     # of `sent`, how many have landed (in order)
        self.num_done = 0
        self.next_id = 0
        self.restored = 0

    # ---------------------------------------------------------------- the fake worker

    def _apply(self, work):
        for block_id, slot in zip(work.store_block_ids, work.store_slots):
            self.cpu[slot] = list(self.gpu[block_id])
        for slot, block_id in zip(work.load_slots, work.load_block_ids):
            self.gpu[block_id] = list(self.cpu[slot])

    @rule()
    def send(self):
        work = self.kv.take_offload_work()
        if work is not None and work.has_copies:
            self.sent.append(work)

    @precondition(lambda self: self.applied < len(self.sent))
    @rule()
    def land_one(self):
        self._apply(self.sent[self.applied])
        self.applied += 1

    @rule(n=st.integers(0, 3))
    def report(self, n):
        n = min(n, len(self.sent))
        for _ in range(n):
            work = self.sent.popleft()
            if self.applied:
                self.applied -= 1
            else:
                self._apply(work)
        self.num_done += n
        for rid in self.kv.complete_offload(KVOffloadReport(self.num_done)):
            req, num_computed, aborted = self.loading.pop(rid)
            if aborted:
                self.kv.free(req)
                continue
            self._check_tokens(req, num_computed)
            self.restored += 1
            req.num_computed_tokens = num_computed
            self.kv.cache_blocks(req, num_computed)
            self.live[rid] = req

    # ---------------------------------------------------------------- the scheduler's part

    def _check_tokens(self, req, num_tokens):
        ids = self.kv.get_block_ids(req.request_id)
        for b in range(num_tokens // BS):
            assert self.gpu[ids[b]] == req.all_token_ids[b * BS:(b + 1) * BS], f"block {b} of {req!r}"

    def _in_flight(self) -> set[int]:
        out = set()
        for work in self.sent:
            out |= set(work.store_block_ids) | set(work.load_block_ids)
        return out

    def _write(self, req, start, end):
        ids = self.kv.get_block_ids(req.request_id)
        in_flight = self._in_flight()
        for pos in range(start, end):
            block = self.kv.block_pool.blocks[ids[pos // BS]]
            assert block.ref_cnt == 1 and block.block_id not in in_flight, f"write into {block!r}"
            self.gpu.setdefault(block.block_id, [None] * BS)[pos % BS] = req.all_token_ids[pos]

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=6),
          chunk=st.integers(1, 16))
    def admit(self, prefix, suffix, chunk):
        req = Request(f"r{self.next_id}", prefix + suffix, Params(), eos_token_id=None)
        self.next_id += 1
        hit_blocks, num_hit = self.kv.get_computed_blocks(req)
        self._check_tokens_of(req, hit_blocks)
        slots = self.kv.get_cpu_hits(req, len(hit_blocks))
        if slots:
            if self.kv.start_load(req, hit_blocks, num_hit, slots):
                self.loading[req.request_id] = (req, num_hit + len(slots) * BS, False)
            return
        num_new = min(chunk, req.num_tokens - num_hit)
        if self.kv.allocate_slots(req, num_new, num_hit, hit_blocks) is None:
            return
        req.num_computed_tokens = num_hit
        self.live[req.request_id] = req
        self._compute(req, num_new)

    def _check_tokens_of(self, req, blocks):
        for b, block in enumerate(blocks):
            assert self.gpu[block.block_id] == req.all_token_ids[b * BS:(b + 1) * BS]

    def _compute(self, req, num_new):
        start = req.num_computed_tokens
        self._write(req, start, start + num_new)
        req.num_computed_tokens += num_new
        self.kv.cache_blocks(req, req.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 6), token=st.integers(0, 3))
    def step(self, data, chunk, token):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if req.num_computed_tokens >= req.num_tokens:
            req.append_output_token_ids([token])
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        if self.kv.allocate_slots(req, num_new) is None:
            self.kv.free(req)                       # preempted (its cached blocks go to the tier)
            del self.live[req.request_id]
            return
        self._compute(req, num_new)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        self.kv.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    @rule()
    def evict_gpu(self):
        """A request takes every free block (evicting what the GPU pool cached) and ends, its
        own blocks uncached (so that it does not flood the CPU tier as well)."""
        n = self.kv.num_free_blocks
        if n == 0:
            return
        req = Request(f"e{self.next_id}", [1000 + self.next_id] * (n * BS), Params(), eos_token_id=None)
        self.next_id += 1
        assert self.kv.allocate_slots(req, n * BS) is not None
        self._write(req, 0, n * BS)
        self.kv.free(req)

    @precondition(lambda self: any(not a for _, _, a in self.loading.values()))
    @rule(data=st.data())
    def abort_loading(self, data):
        rid = data.draw(st.sampled_from(sorted(r for r, (_, _, a) in self.loading.items() if not a)))
        req, n, _ = self.loading[rid]
        self.loading[rid] = (req, n, True)          # its blocks are freed once the load is over

    @invariant()
    def consistent(self):
        self.kv.check_integrity()
        free = set(self.kv.block_pool._free_queue)
        assert not free & self._in_flight(), "a block is both free and in flight"
        refs, _ = self.kv.offload.references()
        assert not free & set(refs)
        held = {b for rid in list(self.live) + list(self.loading) for b in self.kv.get_block_ids(rid)}
        assert len(held | set(refs)) + self.kv.num_free_blocks == self.kv.num_usable_blocks

    def teardown(self):
        for rid, (req, n, _) in list(self.loading.items()):
            self.loading[rid] = (req, n, True)
        while self.kv.has_offload_work or self.sent:
            self.send()
            self.report(3)
        for req in list(self.live.values()):
            self.kv.free(req)
        while self.kv.has_offload_work or self.sent:      # the stores of those last frees
            self.send()
            self.report(3)
        self.kv.check_integrity()
        assert self.kv.num_free_blocks == self.kv.num_usable_blocks
        assert not self.loading and self.kv.offload.references() == ({}, {})
        TwoTierMachine.restores += self.restored


TwoTierMachine.restores = 0
# derandomized: the same sequences every run, so the restore count below is the same too
TwoTierMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None,
                                           derandomize=True, database=None)
TestTwoTierAccounting = TwoTierMachine.TestCase


def test_the_random_sequences_restore_prefixes():
    """The machine above is only worth something if restores happen in it."""
    assert TwoTierMachine.restores > 0


# ------------------------------------------------------------------ the scheduler with a tier


class OffloadRunner(FakeRunner):
    """The shadow-KV fake model plus a CPU tier whose copies land a random number of steps
    after they were sent (in order), as a side stream's would."""

    def __init__(self, block_size, rng):
        super().__init__(block_size)
        self.rng = rng
        self.host: dict[int, list] = {}
        self.sent: deque = deque()
        self.done = 0

    def execute(self, so):
        work = (so.kv_connector_metadata or {}).get("cpu_tier")
        if work is not None and work.has_copies:
            self.sent.append(work)
        out = super().execute(so)            # the forward runs while the copies are in flight
        while self.sent and self.rng.random() < 0.6:
            work = self.sent.popleft()
            for block_id, slot in zip(work.store_block_ids, work.store_slots):
                self.host[slot] = list(self.cache[block_id])
            for slot, block_id in zip(work.load_slots, work.load_block_ids):
                self.cache[block_id] = list(self.host[slot])
            self.done += 1
        if work is not None and work.poll:
            out.kv_connector_output = {"cpu_tier": [KVOffloadReport(self.done)]}
        return out


@pytest.mark.parametrize("seed", range(6))
def test_sessions_through_the_scheduler_with_a_tier(seed):
    """Four multi-turn sessions through a 12-block pool and a 16-slot tier, copies landing late,
    some requests aborted while their prefix loads (the turn is sent again): every turn's
    tokens are the reference model's, nothing stalls, and both tiers end clean."""
    import random
    rng = random.Random(seed)
    bs = 4
    kv = KVCacheManager(12, bs, num_cpu_blocks=16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4), kv, max_model_len=64,
                      kv_connector=CPUTierConnector(kv))
    runner = OffloadRunner(bs, rng)
    convs = [[rng.randrange(97) for _ in range(rng.randrange(6, 14))] for _ in range(4)]
    turns = [0] * 4
    live: dict[str, int] = {}              # request id -> session
    got: dict[str, list[int]] = {}
    n = 0
    aborted = 0
    for _ in range(3000):
        for s in range(4):
            if s not in live.values() and turns[s] < 4 and len(convs[s]) + 6 < 64:
                rid = f"s{s}t{turns[s]}n{n}"
                n += 1
                sched.add_request(Request(rid, convs[s], Params(max_tokens=4), eos_token_id=None))
                live[rid] = s
                got[rid] = []
        if not live and not kv.has_offload_work:
            break
        loading = [rid for rid, (r, _, _) in sched.kv_waiting.items() if not r.is_finished]
        if loading and rng.random() < 0.15:
            sched.abort_requests([loading[0]])
            del live[loading[0]]
            aborted += 1
        so = sched.schedule()
        mro = runner.execute(so)
        if mro.kv_connector_output is not None:
            sched.update_kv_connectors(mro.kv_connector_output)
        for out in sched.update_from_output(so, mro):
            got[out.request_id] += out.new_token_ids
            if out.finished:
                s = live.pop(out.request_id)
                assert got[out.request_id] == reference(convs[s], 4), out.request_id
                convs[s] = convs[s] + got[out.request_id] + [rng.randrange(97) for _ in range(3)]
                turns[s] += 1
        sched.check_integrity()
    else:
        raise AssertionError("the sessions did not finish")
    assert turns == [4, 4, 4, 4] or all(len(c) + 6 >= 64 or t == 4 for c, t in zip(convs, turns))
    assert sched.num_kv_loads > 0
    sched.schedule()
    sched.check_integrity()
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.offload.references() == ({}, {})
    assert all(r.status != RequestStatus.WAITING_FOR_KV for r, _, _ in sched.kv_waiting.values())


# ------------------------------------------------------------------ flags and metrics

@pytest.mark.parametrize("flags, message", [
    (dict(kv_offloading_backend="lmcache"), "unsupported value 'lmcache' (supported: native)"),
    (dict(kv_offloading_size=0), "positive number of GiB, got 0"),
    (dict(kv_offloading_size=-2.0), "positive number of GiB, got -2.0"),
    (dict(kv_offloading_size=float("nan")), "positive number of GiB"),
    (dict(kv_offloading_size=4, enable_prefix_caching=False), "needs prefix caching"),
])
def test_bad_offloading_flags_are_named(flags, message):
    from m3serve.config import EngineConfig
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig.from_kwargs(**flags)


def test_offloading_flags_on_the_command_line():
    import argparse

    from m3serve.config import EngineConfig
    from m3serve.engine_args import add_engine_args, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-offloading-size", "0.5", "--kv-offloading-backend", "native"])
    cache = EngineConfig.from_kwargs(**engine_kwargs(args)).cache
    assert cache.kv_offloading_size == 0.5 and cache.kv_offloading_bytes == 1 << 29
    assert EngineConfig.from_kwargs(**engine_kwargs(parser.parse_args([]))).cache.kv_offloading_bytes == 0


def test_offload_metrics_under_their_names():
    from prometheus_client.parser import text_string_to_metric_families

    from m3serve.protocol import EngineStats
    from m3serve.serving.metrics import ServerMetrics
    m = ServerMetrics("tiny")
    m.engine_stats = EngineStats(external_prefix_cache_queries=300, external_prefix_cache_hits=96,
                                 kv_offload_bytes_to_cpu=1000, kv_offload_bytes_to_gpu=500,
                                 kv_offload_seconds_to_cpu=0.25, kv_offload_seconds_to_gpu=0.5,
                                 kv_offload_evictions=3, kv_offload_usage=0.75, prefix_cache_queries=300,
                                 prefix_cache_hits=32)
    samples = {(s.name, s.labels.get("direction")): s.value
               for f in text_string_to_metric_families(m.render("m3serve").decode()) for s in f.samples}
    assert samples[("m3serve:external_prefix_cache_queries_total", None)] == 300
    assert samples[("m3serve:external_prefix_cache_hits_total", None)] == 96
    assert samples[("m3serve:prefix_cache_hits_total", None)] == 32          # the GPU tier's own
    assert samples[("m3serve:kv_offload_bytes_total", "to_cpu")] == 1000
    assert samples[("m3serve:kv_offload_bytes_total", "to_gpu")] == 500
    assert samples[("m3serve:kv_offload_seconds_total", "to_cpu")] == 0.25
    assert samples[("m3serve:kv_offload_seconds_total", "to_gpu")] == 0.5
    assert samples[("m3serve:kv_offload_evictions_total", None)] == 3
    assert samples[("m3serve:kv_offload_usage_perc", None)] == 0.75


def test_a_tier_smaller_than_a_block_is_refused(tiny_dir):
    from m3serve.llm import LLM
    with pytest.raises(ValueError, match="less than one KV block"):
        LLM(str(tiny_dir), dtype="float32", kv_offloading_size=1e-9)


def test_dp_replicas_tier_stats_add_up():
    from m3serve.engine.engine_group import ReplicaBook
    from m3serve.protocol import EngineStats
    a = EngineStats(external_prefix_cache_hits=96, kv_offload_bytes_to_gpu=10, kv_offload_evictions=1,
                    kv_offload_usage=1.0, kv_offload_num_slots=100)
    b = EngineStats(external_prefix_cache_hits=32, kv_offload_bytes_to_gpu=5, kv_offload_evictions=2,
                    kv_offload_usage=0.0, kv_offload_num_slots=300)
    total = ReplicaBook.combine([a, b])
    assert (total.external_prefix_cache_hits, total.kv_offload_bytes_to_gpu, total.kv_offload_evictions) == (128, 15, 3)
    assert total.kv_offload_usage == 0.25          # 100 of 400 slots in use
