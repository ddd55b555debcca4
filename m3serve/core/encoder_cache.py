"""The scheduler's book of encoder outputs: which images and videos (by `encoder_key`) have
their vision-encoder output held on the ranks, which unfinished requests use each, and which
are kept only for reuse, least recently used first, within `--mm-encoder-cache-gb`.

Every hit, encode and eviction is decided here; evictions reach the ranks in
`SchedulerOutput.encoder_cache_frees`, encodes happen where a step reaches a request's item
that the rank's store lacks. Every rank's store (`worker/media.EncoderOutputs`) therefore holds
exactly the keys this book holds, so a hit on one rank is a hit on all.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _Entry:
    num_bytes: int
    users: set[str] = field(default_factory=set)     # unfinished requests that hold it


@dataclass
class EncoderCacheStats:
    """Counts since start. A query is an image or video whose placeholders a step had to
    compute and that its request did not hold yet; a hit found its output here, a miss
    (queries - hits) ran the encoder once."""
    queries: int = 0
    hits: int = 0
    evictions: int = 0        # outputs dropped to stay within the byte bound


class EncoderCacheBook:
    """Encoder outputs by key, with the requests that use them.

    A request holds an output from the step that first needs it (or, if it is already here,
    from its first admission) until the request finishes: its pixels are dropped once it holds
    the output, so a recompute after preemption must find the output here. Held outputs are
    never evicted. The bytes of all outputs (held or not) stay within `capacity_bytes` by
    evicting outputs nobody holds, least recently used first; held outputs alone may exceed it
    (the running requests' own memory). With capacity 0 an output lives exactly as long as a
    request holds it (running requests with the same image still share one output).
    """

    def __init__(self, capacity_bytes: int, bytes_per_token: int):
        if capacity_bytes < 0:
            raise ValueError(f"encoder cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.bytes_per_token = bytes_per_token      # [num_tokens, hidden] in the model's dtype
        self._entries: OrderedDict[str, _Entry] = OrderedDict()   # least recently used first
        self.num_bytes = 0
        self.stats = EncoderCacheStats()
        self._freed: list[str] = []

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def use(self, key: str, request_id: str, num_tokens: int, count: bool = True) -> bool:
        """`request_id` holds the output of `key` from now on; whether it was here (a hit).
        A miss adds it (the rank that needs it encodes it in this step), evicting unheld
        outputs past the byte bound. `count`: a query of the hit-rate counters."""
        entry = self._entries.get(key)
        hit = entry is not None
        if hit:
            self._entries.move_to_end(key)
        else:
            entry = self._entries[key] = _Entry(num_tokens * self.bytes_per_token)
            self.num_bytes += entry.num_bytes
        entry.users.add(request_id)
        if count:
            self.stats.queries += 1
            self.stats.hits += hit
        if not hit:
            self._evict()
        return hit

    def release(self, request_id: str, keys) -> None:
        """A finished request lets go of its outputs; unheld ones stay for reuse within the
        byte bound (the most recently released are evicted last)."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or request_id not in entry.users:
                raise RuntimeError(f"request {request_id!r} releases encoder output {key[:16]} it does not hold")
            entry.users.discard(request_id)
            if not entry.users:
                self._entries.move_to_end(key)
        self._evict()

    def _evict(self, bound: int | None = None) -> None:
        """Evict outputs nobody holds, least recently used first, until the bytes are within
        `bound` (default: the capacity)."""
        bound = self.capacity_bytes if bound is None else bound
        for key in [k for k, e in self._entries.items() if not e.users]:
            if self.num_bytes <= bound:
                return
            self.num_bytes -= self._entries.pop(key).num_bytes
            self.stats.evictions += 1
            self._freed.append(key)

    def drop_unheld(self) -> None:
        """Evict every output nobody holds: after a failed step, whose encodes may not have
        reached every rank's store (its requests were aborted, so nobody holds those)."""
        self._evict(bound=-1)

    def take_freed(self) -> list[str]:
        """Keys evicted since the last call: the ranks drop them before the next step runs."""
        freed, self._freed = self._freed, []
        return freed

    def check_integrity(self, held: dict[str, set[str]]) -> list[str]:
        """Problems (empty: none) given each unfinished request's held keys `held`."""
        problems = []
        if self.num_bytes != sum(e.num_bytes for e in self._entries.values()):
            problems.append("encoder cache: byte count differs from its entries'")
        unheld = sum(e.num_bytes for e in self._entries.values() if not e.users)
        if unheld and self.num_bytes > self.capacity_bytes:
            problems.append(f"encoder cache: {self.num_bytes} bytes past its bound {self.capacity_bytes} "
                            f"with {unheld} bytes nobody holds")
        users = {(rid, key) for key, e in self._entries.items() for rid in e.users}
        holders = {(rid, key) for rid, keys in held.items() for key in keys}
        if users != holders:
            problems.append(f"encoder cache: users {sorted(users ^ holders)[:4]} disagree with the requests")
        return problems
