"""The one-shot all-reduce kernel under the Triton interpreter: one rank's launch against peers
whose side of the protocol (staged data and raised flags) the test writes by hand."""
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run only without a GPU", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

from m3serve.kernels import allreduce as ar

SLOTS = ar.MAX_PROGRAMS


def _ranks(world, max_bytes):
    """Every rank's buffers in this one process; rank 0's pointer tables."""
    bufs = [ar.IpcBuffers(r, world, max_bytes, torch.device("cpu")) for r in range(world)]
    me = bufs[0]
    me.buf_ptrs = torch.tensor([b.staging.data_ptr() for b in bufs], dtype=torch.int64)
    me.flag_ptrs = torch.tensor([b.flags.data_ptr() for b in bufs], dtype=torch.int64)
    return bufs


def _peer_arrives(bufs, r, data, gen, programs):
    """Peer r's side of call `gen`: its data staged in the call's half, its flags raised."""
    half = bufs[r].staging.view(data.dtype).view(2, -1)[gen & 1]
    half[:data.numel()] = data.flatten()
    bufs[0].flags.view(-1, SLOTS)[r, :programs] = gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sums_in_rank_order_and_alternates_halves(dtype):
    world, max_bytes = 3, 4 * ar.BLOCK * 4 * 3
    bufs = _ranks(world, max_bytes)
    run = ar.OneShotAllReduce(bufs[0], max_spins=1000)
    g = torch.Generator().manual_seed(0)
    # calls of different sizes: 1 program, several, and a grid-stride loop past MAX_PROGRAMS
    for gen, numel in enumerate([7, 3 * ar.BLOCK + 5, 5, 2 * ar.BLOCK], start=1):
        parts = [torch.randn(numel, generator=g).to(dtype) for _ in range(world)]
        programs = min(ar.MAX_PROGRAMS, -(-numel // ar.BLOCK))
        for r in range(1, world):
            _peer_arrives(bufs, r, parts[r], gen, programs)
        x = parts[0].clone()
        run(x)
        expect = ar.all_reduce_ref(parts)
        assert torch.equal(x, expect), (gen, numel)
        assert int(bufs[0].gen) == gen and int(bufs[0].counter) == 0
        # rank 0 staged its input in the call's half and flagged every rank's array
        mine = bufs[0].staging.view(dtype).view(2, -1)[gen & 1][:numel]
        assert torch.equal(mine, parts[0])
        for b in bufs:
            assert (b.flags.view(-1, SLOTS)[0, :programs] == gen).all()
    run.check()


def test_a_flag_already_past_this_call_counts():
    """A fast peer may flag call g + 1 before this rank has read its flag of call g."""
    bufs = _ranks(2, 4 * ar.BLOCK * 4)
    run = ar.OneShotAllReduce(bufs[0], max_spins=10)
    y = torch.arange(5, dtype=torch.float32)
    _peer_arrives(bufs, 1, y, 1, 1)
    bufs[0].flags.view(-1, SLOTS)[1, 0] = 2
    x = torch.ones(5)
    run(x)
    run.check()
    assert torch.equal(x, y + 1)


def test_a_missing_peer_times_out_and_check_raises():
    bufs = _ranks(2, 4 * ar.BLOCK * 4)
    run = ar.OneShotAllReduce(bufs[0], max_spins=50)
    run(torch.ones(16))                         # rank 1 never arrives
    with pytest.raises(RuntimeError, match="timed out"):
        run.check()


def test_refuses_what_it_cannot_take():
    bufs = _ranks(2, 1024)
    run = ar.OneShotAllReduce(bufs[0])
    assert not run.accepts(torch.ones(257))                   # 1028 bytes > 1024
    assert not run.accepts(torch.ones(8, 8).t())              # not contiguous
    assert not run.accepts(torch.ones(8, dtype=torch.int32))  # not a float
    assert run.accepts(torch.ones(256))
    with pytest.raises(ValueError, match="at most 1024 bytes"):
        run(torch.ones(300))
