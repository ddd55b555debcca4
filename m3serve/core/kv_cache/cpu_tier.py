"""The CPU tier's books: which host slot holds which prefix-cached block, by content hash.

One slot holds one whole block of every cache group that shares the block ids (main K/V, the
index keys, the draft's caches) on every rank; the workers own the bytes, this class only says
which slot is which. A slot is free (no content), cached (content, evictable, in LRU order) or
pinned (a copy into or out of it is in flight: never evicted, never rewritten).
"""
from __future__ import annotations

from collections import OrderedDict


class CPUBlockTier:
    """Slots 0..num_slots-1 of the host-memory tier, evicted least recently used first.

    `store_slot(hash)` picks a slot for a block about to be copied out (pinned until `unpin`);
    `lookup(hashes)` finds the leading run of hashes held; `pin`/`unpin` bracket a copy back in.
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the CPU tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._hash_of: list[bytes | None] = [None] * num_slots
        self._refs = [0] * num_slots
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()   # unpinned slots with content, oldest first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))   # pop() gives the lowest slot
        self.num_evictions = 0

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_slots / self.num_slots

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """Slots of the leading run of `block_hashes` the tier holds (counts as a use)."""
        slots = []
        for block_hash in block_hashes:
            slot = self._by_hash.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
        for slot in slots:
            if slot in self._lru:
                self._lru.move_to_end(slot)
        return slots

    def touch(self, block_hash: bytes) -> None:
        """The block was used again: it becomes the most recent."""
        slot = self._by_hash.get(block_hash)
        if slot is not None and slot in self._lru:
            self._lru.move_to_end(slot)

    def store_slot(self, block_hash: bytes) -> int | None:
        """A pinned slot registered under `block_hash` for a copy out of the GPU, or None when
        the tier already holds it or every slot is pinned. Evicts the least recent block if
        no slot is free."""
        if block_hash in self._by_hash:
            return None
        if self._free:
            slot = self._free.pop()
        elif self._lru:
            slot, _ = self._lru.popitem(last=False)
            del self._by_hash[self._hash_of[slot]]
            self.num_evictions += 1
        else:
            return None
        self._hash_of[slot] = block_hash
        self._by_hash[block_hash] = slot
        self._refs[slot] = 1
        return slot

    def pin(self, slots: list[int]) -> None:
        """A copy out of these slots starts: keep them until `unpin`."""
        for slot in slots:
            if self._hash_of[slot] is None:
                raise RuntimeError(f"CPU slot {slot} holds nothing and cannot be pinned")
            self._lru.pop(slot, None)
            self._refs[slot] += 1

    def unpin(self, slots: list[int]) -> None:
        """A copy into or out of these slots is over; unpinned slots become evictable."""
        for slot in slots:
            if self._refs[slot] <= 0:
                raise RuntimeError(f"CPU slot {slot} unpinned more often than pinned")
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                self._lru[slot] = None

    def reset(self) -> bool:
        """Forget every block; only when nothing is pinned. Returns whether it happened."""
        if any(self._refs):
            return False
        evictions = self.num_evictions
        self.__init__(self.num_slots)
        self.num_evictions = evictions
        return True

    def check_integrity(self, expected_pins: dict[int, int] | None = None) -> list[str]:
        """Inconsistencies (empty = fine): each slot is exactly one of free, cached, pinned; the
        hash map and the slots agree; with `expected_pins` (slot -> copies in flight) the pins
        match."""
        problems = []
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("a CPU slot is free twice")
        for slot in range(self.num_slots):
            h, refs, in_lru = self._hash_of[slot], self._refs[slot], slot in self._lru
            if slot in free:
                if h is not None or refs or in_lru:
                    problems.append(f"free CPU slot {slot} has content, pins or an LRU entry")
                continue
            if h is None or self._by_hash.get(h) != slot:
                problems.append(f"CPU slot {slot} in use without a registered hash")
            if refs < 0 or (refs == 0) != in_lru:
                problems.append(f"CPU slot {slot}: {refs} pins but {'in' if in_lru else 'not in'} the LRU")
            if expected_pins is not None and refs != expected_pins.get(slot, 0):
                problems.append(f"CPU slot {slot}: {refs} pins, but {expected_pins.get(slot, 0)} copies use it")
        if len(self._by_hash) != self.num_slots - len(free):
            problems.append("CPU tier hash map and used slots differ in size")
        return problems
