"""BlockPool: allocation order, refcounts, eviction of cached hashes, integrity checking."""
import pytest

from m3serve.core.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from m3serve.core.kv_cache.hashing import hash_block, request_block_hashes


def h(i: int) -> bytes:
    return hash_block(None, (i,), None)


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert NULL_BLOCK_ID not in [b.block_id for b in blocks]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(RuntimeError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    pool.check_integrity()
    assert pool.num_free_blocks == 4 and pool.usage == 0.0


def test_too_small_pool_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_free_order_tail_of_sequence_evicted_first_and_uncached_before_cached():
    pool = BlockPool(7)
    seq = pool.get_new_blocks(4)  # ids 1..4
    assert [b.block_id for b in seq] == [1, 2, 3, 4]
    pool.cache_full_blocks(seq, [h(0), h(1), h(2)], 0, 3)  # 3 full blocks, last one partial
    pool.free_blocks(seq)
    pool.check_integrity()
    # Free queue was [5, 6]; uncached block 4 goes to the head, cached 3, 2, 1 (reversed) to the tail.
    order = [b.block_id for b in pool.get_new_blocks(6)]
    assert order == [4, 5, 6, 3, 2, 1]


def test_reuse_evicts_hash_and_touch_removes_from_free_queue():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [h(1), h(2)], 0, 2)
    pool.free_blocks([a, b])
    assert pool.get_cached_block(h(1)) is a
    # A prefix hit takes the block out of the free queue.
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.check_integrity({a.block_id: 1})
    # The only free block is b; reusing it forgets its hash.
    (c,) = pool.get_new_blocks(1)
    assert c is b and c.block_hash is None and pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is a
    pool.touch([a])  # a second holder
    pool.free_blocks([a])
    pool.free_blocks([a, c])
    pool.check_integrity()
    assert pool.num_free_blocks == 2


def test_duplicate_content_keeps_first_copy():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [h(7)], 0, 1)
    pool.cache_full_blocks([b], [h(7)], 0, 1)
    assert pool.get_cached_block(h(7)) is a and b.block_hash is None
    pool.free_blocks([a, b])
    pool.check_integrity()


def test_double_free_and_null_free_raise():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="null block"):
        pool.free_blocks([pool.null_block])
    pool.check_integrity()


def test_integrity_detects_corruption():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="ref_cnt 1, but requests hold 0"):
        pool.check_integrity({a.block_id: 1})
    a.ref_cnt = 0  # a leak: ref 0 but not in the free queue
    with pytest.raises(RuntimeError, match="leaked block"):
        pool.check_integrity()
    a.ref_cnt = 1
    b.block_hash = h(3)  # hash not registered in the map
    with pytest.raises(RuntimeError, match="hash not in the cache map"):
        pool.check_integrity()
    b.block_hash = None
    pool.free_blocks([a, b])
    pool.check_integrity()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [h(1), h(2)], 0, 2)
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(2)) is b
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h(1)) is None and a.block_hash is None
    pool.check_integrity()


def test_caching_disabled_registers_nothing():
    pool = BlockPool(3, enable_caching=False)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [h(1), h(2)], 0, 2)
    assert pool.get_cached_block(h(1)) is None
    pool.free_blocks([a, b])
    pool.check_integrity()


def test_block_hash_chain_and_salt():
    tokens = list(range(10))
    hashes = request_block_hashes(tokens, 4)
    assert len(hashes) == 2  # the partial third block is never hashed
    assert hashes[0] == hash_block(None, (0, 1, 2, 3), None)
    assert hashes[1] == hash_block(hashes[0], (4, 5, 6, 7), None)
    # Incremental: continuing from known hashes gives the same chain.
    more = request_block_hashes(tokens + [10, 11], 4, known_hashes=hashes)
    assert len(more) == 1 and more[0] == request_block_hashes(tokens + [10, 11], 4)[2]
    # Same second block, different first block -> different second hash (it is chained).
    other = request_block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert other[1] != hashes[1]
    # The salt changes the first block and, through the chain, every later one.
    salted = request_block_hashes(tokens, 4, cache_salt="tenant-a")
    assert salted[0] != hashes[0] and salted[1] != hashes[1]
    assert salted[1] == hash_block(salted[0], (4, 5, 6, 7), None)
    # Parent encodings do not collide.
    assert hash_block(1, (1,), None) != hash_block(None, (1,), None) != hash_block(b"1", (1,), None)
