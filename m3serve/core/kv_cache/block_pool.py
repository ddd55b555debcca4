"""The pool of physical KV blocks: reference counts, the free queue and the prefix-cache map.

One block id addresses one page in every cache group (main K/V and the index cache), so the pool
hands out ids once and all groups follow. Freed blocks keep their content hash until they are
reused, which is what lets a later request hit them in the prefix cache.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

NULL_BLOCK_ID = 0


class KVBlock:
    """One physical KV page. `block_hash` is set once the page holds a full, hashed block."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class BlockPool:
    """Allocates, reference-counts and prefix-caches KV blocks.

    Block 0 is reserved as the null block: it is never handed out, so the worker may point padding
    slots (CUDA-graph padding, unused block-table entries) at it and write garbage there safely.
    Usable blocks are therefore `num_blocks - 1`.

    The free queue holds every block with ref_cnt 0, in eviction order (head = next to reuse).
    A free block may still carry a hash; reusing it evicts that hash from the prefix cache.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # OrderedDict as a doubly-linked list: O(1) pop at the head, append, and remove by id.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 = all free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the head of the free queue, each with ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"cannot get {num_blocks} blocks: only {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block of a request's list (given in sequence order).

        Blocks reaching 0 go to the free queue in reverse sequence order, so a sequence's tail is
        evicted before its head (the head is the part other requests are likeliest to share).
        Blocks without a hash go to the queue head: they can never be hit, so reuse them first.
        """
        for block in reversed(blocks):
            if block.block_id == NULL_BLOCK_ID:
                raise RuntimeError("the null block is never allocated and cannot be freed")
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id} (ref_cnt {block.ref_cnt})")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block
                if block.block_hash is None:
                    self._free_queue.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, blocks: list[KVBlock], block_hashes: list[bytes],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under their hashes.

        A block already carrying a hash (a prefix hit) is left alone. If another block already
        holds the same content, this one stays unregistered; the first copy serves future hits.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            if block_hashes[i] in self._cached:
                continue
            block.block_hash = block_hashes[i]
            self._cached[block_hashes[i]] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Only allowed when no block is held; returns whether it happened."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise RuntimeError listing every inconsistency: leaks, double frees, bad refcounts.

        Invariants: each usable block is either in the free queue with ref_cnt 0 or held with
        ref_cnt > 0; the queue holds only valid, distinct, non-null blocks; the hash map and the
        blocks' hashes agree. With `expected_refs` (block id -> references held by requests),
        every block's ref_cnt must equal it (0 for ids not listed).
        """
        problems = []
        null = self.null_block
        if null.ref_cnt != 0 or null.block_hash is not None or NULL_BLOCK_ID in self._free_queue:
            problems.append(f"null block was used: {null!r}")
        for block_id, block in self._free_queue.items():
            if not 0 < block_id < self.num_blocks or self.blocks[block_id] is not block:
                problems.append(f"free queue entry {block_id} is not the pool's block ({block!r})")
        for block in self.blocks[1:]:
            in_queue = block.block_id in self._free_queue
            if block.ref_cnt < 0:
                problems.append(f"negative ref_cnt: {block!r}")
            elif block.ref_cnt == 0 and not in_queue:
                problems.append(f"leaked block (ref 0, not in free queue): {block!r}")
            elif block.ref_cnt > 0 and in_queue:
                problems.append(f"held block in free queue: {block!r}")
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                problems.append(f"block hash not in the cache map: {block!r}")
            if expected_refs is not None and block.ref_cnt != expected_refs.get(block.block_id, 0):
                problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt}, but requests "
                                f"hold {expected_refs.get(block.block_id, 0)}")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                problems.append(f"cache map entry {block_hash[:4].hex()} points at {block!r}")
        if expected_refs is not None:
            for block_id in expected_refs:
                if not 0 < block_id < self.num_blocks:
                    problems.append(f"requests hold invalid block id {block_id}")
        if problems:
            raise RuntimeError("KV block pool integrity check failed:\n  " + "\n  ".join(problems))
