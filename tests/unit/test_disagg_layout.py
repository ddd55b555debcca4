"""The descriptor plan of a KV pull, executed on simulated memory: every consumer rank ends up
with exactly its heads of the producer's blocks, for equal and different TP sizes (including
replicated heads), in both cache groups, and contiguous runs are merged."""
import numpy as np
import pytest

from m3serve.disagg.layout import LayoutMismatch, check_compatible, merge_descriptors, plan_pull
from m3serve.disagg.messages import Region
from m3serve.distributed import GroupInfo
from m3serve.layers.linear import kv_head_range

BS, D, DI, ITEM = 4, 3, 5, 2          # block size, head dim, index dim, bytes per element


class Memory:
    """Numpy buffers at fake addresses."""

    def __init__(self):
        self.buffers: list[tuple[int, np.ndarray]] = []
        self.next = 1 << 20

    def alloc(self, shape) -> tuple[int, np.ndarray]:
        a = np.zeros(shape, dtype=np.int16)
        base = self.next
        self.next += (a.nbytes + 4095) // 4096 * 4096 + 4096
        self.buffers.append((base, a))
        return base, a

    def view(self, addr: int, n: int) -> np.ndarray:
        for base, a in self.buffers:
            if base <= addr and addr + n <= base + a.nbytes:
                return a.reshape(-1).view(np.uint8)[addr - base:addr - base + n]
        raise AssertionError(f"descriptor [{addr}, +{n}) is outside every buffer")


def make_rank(mem, num_layers, num_blocks, heads, tp, rank, sparse):
    first, n = kv_head_range(heads, GroupInfo(rank, tp))
    regions, arrays = [], {}
    for layer in range(num_layers):
        base, kv = mem.alloc((2, num_blocks, BS, n, D))
        block = BS * n * D * ITEM
        for plane, off in (("k", 0), ("v", num_blocks * block)):
            regions.append(Region(f"{layer}.{plane}", base + off, block, n * D * ITEM, D * ITEM, first, n, heads))
        arrays[(layer, "kv")] = kv
        if layer in sparse:
            base, index = mem.alloc((num_blocks, BS, DI))
            regions.append(Region(f"{layer}.index", base, BS * DI * ITEM, DI * ITEM, DI * ITEM, 0, 1, 1))
            arrays[(layer, "index")] = index
    return regions, arrays, (first, n)


@pytest.mark.parametrize("heads, p, d", [(2, 1, 1), (2, 1, 2), (2, 2, 1), (4, 2, 4), (4, 4, 2), (2, 4, 1),
                                         (2, 1, 4), (2, 4, 2), (8, 2, 2)])
def test_pull_plan_moves_the_right_heads(heads, p, d):
    rng = np.random.default_rng(heads * 100 + p * 10 + d)
    layers, sparse, nb = 3, {1, 2}, 12
    truth = {layer: rng.integers(-30000, 30000, size=(2, nb, BS, heads, D)).astype(np.int16) for layer in range(layers)}
    index_truth = {layer: rng.integers(-30000, 30000, size=(nb, BS, DI)).astype(np.int16) for layer in sparse}
    mem = Memory()
    producers = {}
    for r in range(p):
        regions, arrays, (first, n) = make_rank(mem, layers, nb, heads, p, r, sparse)
        for layer in range(layers):
            arrays[(layer, "kv")][...] = truth[layer][:, :, :, first:first + n]
            if layer in sparse:
                arrays[(layer, "index")][...] = index_truth[layer]
        producers[r] = regions
    remote_blocks, local_blocks = [7, 8, 9, 2, 5], [1, 2, 3, 9, 4]
    for j in range(d):
        regions, arrays, (first, n) = make_rank(mem, layers, nb, heads, d, j, sparse)
        check_compatible(regions, producers[0], BS, BS)
        plan = plan_pull(regions, producers, BS, local_blocks, remote_blocks, j)
        for loc, rem, length in plan.values():
            for a, b, k in zip(loc, rem, length):
                mem.view(int(a), int(k))[:] = mem.view(int(b), int(k))
        for layer in range(layers):
            got = arrays[(layer, "kv")][:, local_blocks]
            np.testing.assert_array_equal(got, truth[layer][:, remote_blocks, :, first:first + n])
            untouched = [b for b in range(nb) if b not in local_blocks]
            assert not arrays[(layer, "kv")][:, untouched].any()
            if layer in sparse:
                np.testing.assert_array_equal(arrays[(layer, "index")][local_blocks], index_truth[layer][remote_blocks])
        if p == d:        # same heads: whole blocks, and the consecutive ones merged
            assert sum(len(x[0]) for x in plan.values()) < len(local_blocks) * len(regions)


def test_merge_descriptors_joins_runs_contiguous_on_both_sides():
    loc = np.array([0, 10, 20, 50, 60], dtype=np.int64)
    rem = np.array([100, 110, 125, 135, 145], dtype=np.int64)
    n = np.full(5, 10, dtype=np.int64)
    a, b, k = merge_descriptors(loc, rem, n)
    assert a.tolist() == [0, 20, 50] and b.tolist() == [100, 125, 135] and k.tolist() == [20, 10, 20]


def test_layout_mismatches_are_named():
    mem = Memory()
    mine, _, _ = make_rank(mem, 2, 4, 2, 1, 0, {1})
    theirs, _, _ = make_rank(mem, 3, 4, 2, 1, 0, {1})
    with pytest.raises(LayoutMismatch, match="cache planes differ"):
        check_compatible(mine, theirs, BS, BS)
    with pytest.raises(LayoutMismatch, match="block size"):
        check_compatible(mine, mine, BS, 2 * BS)
    other = [Region(r.name, r.base, r.block_stride, r.token_stride, r.head_bytes * 2, r.head_start, r.num_heads,
                    r.total_heads) for r in mine]
    with pytest.raises(LayoutMismatch, match="heads of"):
        check_compatible(mine, other, BS, BS)
