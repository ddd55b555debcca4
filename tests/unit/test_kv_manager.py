"""KVCacheManager: prefix hits, slot allocation, caching, freeing; a stateful random test."""
import functools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from m3serve.core.kv_cache.manager import KVCacheManager
from m3serve.core.request import Request
from m3serve.sampling_params import SamplingParams

# the real sampling params; the scheduler reads max_tokens, min_tokens, stop_token_ids, ignore_eos
Params = functools.partial(SamplingParams, max_tokens=16)


def make_request(rid, tokens, salt=None):
    return Request(rid, tokens, Params(), eos_token_id=None, cache_salt=salt)


def admit(kv, req, num_new=None):
    """Prefix lookup + allocation + 'compute' the chunk; returns the hit size."""
    hit_blocks, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    assert kv.allocate_slots(req, num_new, num_hit, hit_blocks) is not None
    req.num_computed_tokens = num_hit + num_new
    kv.cache_blocks(req, req.num_computed_tokens)
    return num_hit


def assert_all_free(kv):
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_prefix_hit_full_blocks_never_whole_prompt():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(8)))  # exactly two full blocks
    assert admit(kv, a) == 0
    a_ids = kv.get_block_ids("a")
    kv.free(a)
    b = make_request("b", list(range(8)))
    # Both blocks are cached, but the last token must be recomputed: only one block hits.
    assert admit(kv, b) == 4
    c = make_request("c", list(range(9)))
    assert admit(kv, c) == 8
    assert kv.get_block_ids("b")[0] == kv.get_block_ids("c")[0] == a_ids[0]
    assert kv.get_block_ids("c")[1] == a_ids[1]
    assert kv.prefix_cache_queries == 8 + 8 + 9 and kv.prefix_cache_hits == 4 + 8
    for r in (b, c):
        kv.free(r)
    assert_all_free(kv)


def test_hit_shares_the_same_physical_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    b = make_request("b", list(range(8)) + [99, 98])
    assert admit(kv, b) == 8
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2] != kv.get_block_ids("a")[2]
    kv.check_integrity()  # the shared blocks have ref_cnt 2
    kv.free(a)
    kv.free(b)
    assert_all_free(kv)


def test_cache_salt_isolates():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(9)), salt="x")
    admit(kv, a)
    kv.free(a)
    assert admit(kv, make_request("b", list(range(9)), salt="y")) == 0
    assert admit(kv, make_request("c", list(range(9)), salt="x")) == 8
    kv.free(make_request("b", [1]))
    kv.free(make_request("c", [1]))
    assert_all_free(kv)


def test_allocation_failure_allocates_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable blocks
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8) == [1, 2]
    b = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert not kv.has_blocks("b") and kv.num_free_blocks == 1
    kv.check_integrity()
    # Growing a by one token stays inside its second block; the ninth token needs a third.
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 0) == []
    assert kv.allocate_slots(a, 1) == [3]
    assert kv.allocate_slots(a, 5) is None  # 8 + 5 tokens need a fourth block
    assert kv.get_block_ids("a") == [1, 2, 3]
    kv.free(a)
    kv.free(a)  # idempotent
    assert_all_free(kv)


def test_free_hit_blocks_count_against_the_free_pool():
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable
    a = make_request("a", list(range(9)))
    admit(kv, a)  # 3 blocks, first two cached
    kv.free(a)
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])  # 13 tokens -> 4 blocks
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit_blocks) is None
    assert all(blk.ref_cnt == 0 for blk in hit_blocks)  # nothing was touched on failure
    kv.check_integrity()
    c = make_request("c", list(range(8)) + [60])
    hit_blocks, num_hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 1, num_hit, hit_blocks) == [1, 2, 3]
    kv.free(c)
    assert_all_free(kv)


def test_remote_kv_and_lookahead_reserve_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request("r", list(range(10)))
    # 9 tokens' KV arrive from a prefill worker, the last one is computed here, plus 3 lookahead.
    ids = kv.allocate_slots(r, 1, num_new_computed_tokens=9, num_lookahead_tokens=3)
    assert len(ids) == 4  # ceil((9 + 1 + 3) / 4)
    with pytest.raises(ValueError, match="num_new_tokens=-1"):
        kv.allocate_slots(r, -1)
    kv.free(r)
    assert_all_free(kv)


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert admit(kv, make_request("b", list(range(9)))) == 0
    assert kv.prefix_cache_queries == 0
    kv.free(make_request("b", [1]))
    assert_all_free(kv)


def test_integrity_catches_list_refcount_mismatch():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv._req_to_blocks["a"].append(kv._req_to_blocks["a"][0])
    with pytest.raises(RuntimeError, match="holds a block twice"):
        kv.check_integrity()
    kv._req_to_blocks["a"].pop()
    kv.block_pool.blocks[1].ref_cnt += 1
    with pytest.raises(RuntimeError, match="ref_cnt 2, but requests hold 1"):
        kv.check_integrity()
    kv.block_pool.blocks[1].ref_cnt -= 1
    kv.free(a)
    assert_all_free(kv)


BLOCK_SIZE = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23]]


class KVManagerMachine(RuleBasedStateMachine):
    """Random admit / prefill chunk / decode / free / abort / reset sequences.

    A shadow KV store records which token each slot holds, so a prefix hit is checked to return
    blocks holding exactly the request's tokens, and writes into shared blocks are caught.
    """

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=14, block_size=BLOCK_SIZE)
        self.slots: dict[int, list] = {}
        self.live: dict[str, Request] = {}
        self.next_id = 0

    def _write(self, req, start, end):
        ids = self.kv.get_block_ids(req.request_id)
        for pos in range(start, end):
            block = self.kv.block_pool.blocks[ids[pos // BLOCK_SIZE]]
            assert block.ref_cnt == 1, f"write into shared block {block!r}"
            self.slots.setdefault(block.block_id, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = \
                req.all_token_ids[pos]

    def _compute(self, req, num_new):
        start = req.num_computed_tokens
        if self.kv.allocate_slots(req, num_new) is None:
            self.kv.free(req)  # as a preemption would
            del self.live[req.request_id]
            return
        self._write(req, start, start + num_new)
        req.num_computed_tokens += num_new
        self.kv.cache_blocks(req, req.num_computed_tokens)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=9),
          chunk=st.integers(1, 12), salt=st.sampled_from([None, None, "s"]))
    def admit(self, prefix, suffix, chunk, salt):
        req = make_request(f"r{self.next_id}", prefix[:len(prefix) - len(suffix) % 3] + suffix, salt)
        self.next_id += 1
        hit_blocks, num_hit = self.kv.get_computed_blocks(req)
        assert num_hit < req.num_tokens
        for i, block in enumerate(hit_blocks):
            assert self.slots[block.block_id] == req.all_token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        num_new = min(chunk, req.num_tokens - num_hit)
        free_before = self.kv.num_free_blocks
        if self.kv.allocate_slots(req, num_new, num_hit, hit_blocks) is None:
            assert not self.kv.has_blocks(req.request_id)
            assert self.kv.num_free_blocks == free_before
            return
        req.num_computed_tokens = num_hit
        self.live[req.request_id] = req
        self._write(req, num_hit, num_hit + num_new)
        req.num_computed_tokens += num_new
        self.kv.cache_blocks(req, req.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 6), token=st.integers(0, 3))
    def step(self, data, chunk, token):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if req.num_computed_tokens < req.num_tokens:
            self._compute(req, min(chunk, req.num_tokens - req.num_computed_tokens))
        else:
            req.append_output_token_ids([token])
            self._compute(req, 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(rid))
        assert not self.kv.has_blocks(rid)

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.live.values()))
    @rule(data=st.data())
    def abort_mid_prefill(self, data):
        rid = data.draw(st.sampled_from(sorted(
            r.request_id for r in self.live.values() if r.num_computed_tokens < r.num_tokens)))
        self.kv.free(self.live.pop(rid))

    @rule()
    def reset_prefix_cache(self):
        assert self.kv.reset_prefix_cache() == (not self.live)

    @invariant()
    def consistent(self):
        self.kv.check_integrity()
        held = {bid for rid in self.live for bid in self.kv.get_block_ids(rid)}
        assert len(held) + self.kv.num_free_blocks == self.kv.num_usable_blocks
        assert set(self.kv.request_ids) == set(self.live)

    def teardown(self):
        for req in list(self.live.values()):
            self.kv.free(req)
        self.kv.check_integrity()
        assert self.kv.num_free_blocks == self.kv.num_usable_blocks


KVManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)
TestKVManagerStateful = KVManagerMachine.TestCase
