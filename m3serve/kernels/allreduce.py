"""One-shot all-reduce for small messages over CUDA IPC peer buffers, in Triton.

At decode sizes (a few hundred KB or less) an all-reduce is latency bound: a ring or tree in
NCCL pays several steps of launch and synchronisation. Here every rank instead maps every
peer's staging buffer into its own address space once (CUDA IPC), and one kernel per call
1. copies its input into its own staging buffer,
2. raises its flag in every peer's flag array (release, system scope),
3. waits until every peer's flag has reached this call (acquire, bounded),
4. reads the same slice from every rank's staging buffer and sums them, in rank order (so
   every rank computes the bitwise same sum).
The call counter (`generation`) lives on the device, so a CUDA graph replays the kernel
correctly; the staging buffer alternates between two halves by the generation's parity, which
is safe because a rank can only start call g + 2 after every peer has signalled call g + 1,
i.e. after every peer's kernel for call g (the last reader of that half) has finished.

Every program of one call uses the same slice of the message on all ranks and waits only for
the same program of the other ranks, so the grid is kept small (a grid-stride loop inside a
program) so that all programs of a call can be resident at once.

A wait that exceeds `max_spins` gives up, sets an error word and produces garbage: `check()`
raises when that happened (an all-reduce that never completes would otherwise hang the GPU).
The tests call it; the engine does not yet (it would cost a device synchronisation).

`all_reduce_ref` is the reference: the rank-ordered fp32 sum.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_PROGRAMS = 32           # programs per call, and flag slots per (rank, peer)
BLOCK = 1024                # elements per program per loop step


def all_reduce_ref(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of every rank's tensor in rank order, accumulated in fp32, in parts[0]'s dtype."""
    acc = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        acc += p.float()
    return acc.to(parts[0].dtype)


@triton.jit(do_not_specialize=["n", "rank", "max_spins"])
def _one_shot_kernel(x_ptr, bufs_ptr, flags_ptr, gen_ptr, counter_ptr, err_ptr, n, half, rank,
                     max_spins, WORLD: tl.constexpr, ELEM: tl.constexpr, SLOTS: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    g = tl.load(gen_ptr, volatile=True) + 1
    base = (g & 1) * half                         # this call's half of every staging buffer
    mine = tl.load(bufs_ptr + rank).to(tl.pointer_type(ELEM))
    lane = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, step):     # 1. stage the input
        offs = start + lane
        tl.store(mine + base + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)
    tl.debug_barrier()
    for r in tl.static_range(WORLD):               # 2. flag this call in every rank's array
        peer_flags = tl.load(flags_ptr + r).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(peer_flags + rank * SLOTS + pid, g, sem="release", scope="sys")
    my_flags = tl.load(flags_ptr + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):               # 3. wait for every rank's flag
        spins = 0
        seen = tl.atomic_add(my_flags + r * SLOTS + pid, 0, sem="acquire", scope="sys")
        # a fast peer may already have flagged call g + 1 here: wait for "at least g" (in
        # wrap-around int32 arithmetic, so the counter may overflow)
        while ((seen - g) < 0) & (spins < max_spins):
            seen = tl.atomic_add(my_flags + r * SLOTS + pid, 0, sem="acquire", scope="sys")
            spins += 1
        if (seen - g) < 0:
            tl.atomic_xchg(err_ptr, 1, scope="sys")
    tl.debug_barrier()
    for start in range(pid * BLOCK, n, step):     # 4. the rank-ordered sum, in place
        offs = start + lane
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            src = tl.load(bufs_ptr + r).to(tl.pointer_type(ELEM))
            acc += tl.load(src + base + offs, mask=offs < n, volatile=True).to(tl.float32)
        tl.store(x_ptr + offs, acc.to(ELEM), mask=offs < n)
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.store(gen_ptr, g)                      # the last program ends the call
        tl.atomic_xchg(counter_ptr, 0, sem="release")


_ELEM = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class IpcBuffers:
    """This rank's staging buffer (two halves of `max_bytes`) and flag array, and the device
    addresses of every rank's (its own and the IPC-mapped peers'), as int64 tensors the kernel
    reads. Built in two steps around an all-gather the caller does: `handles()` to send,
    `map(every_rank_handles)` with what came back (rank order)."""

    def __init__(self, rank: int, world: int, max_bytes: int, device: torch.device):
        self.rank, self.world, self.max_bytes, self.device = rank, world, max_bytes, device
        self.staging = torch.zeros(2 * max_bytes, dtype=torch.uint8, device=device)
        self.flags = torch.zeros(world * MAX_PROGRAMS, dtype=torch.int32, device=device)
        self.gen = torch.zeros(1, dtype=torch.int32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self._mapped: list = []        # the peers' tensors, kept alive with the mappings
        self.buf_ptrs = self.flag_ptrs = None

    def handles(self) -> tuple:
        """Picklable CUDA IPC handles of the staging buffer and the flags (zeroed first)."""
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.synchronize(self.device)
        return reduce_tensor(self.staging), reduce_tensor(self.flags)

    def map(self, every_rank: list) -> None:
        """Open every peer's handles (raises where the GPUs have no peer access)."""
        bufs, flags = [], []
        for r, (staging, flag) in enumerate(every_rank):
            if r == self.rank:
                pair = (self.staging, self.flags)
            else:
                pair = (staging[0](*staging[1]), flag[0](*flag[1]))
                self._mapped.append(pair)
                self._reach(pair[0].device)
            bufs.append(pair[0].data_ptr())
            flags.append(pair[1].data_ptr())
        self.buf_ptrs = torch.tensor(bufs, dtype=torch.int64, device=self.device)
        self.flag_ptrs = torch.tensor(flags, dtype=torch.int64, device=self.device)

    def _reach(self, peer: torch.device) -> None:
        """Make a peer GPU's memory readable by this GPU's kernels: torch enables peer access
        between two devices the first time it copies between them (the IPC mapping alone does
        not), so copy both ways."""
        if peer == self.device:
            return
        if not torch.cuda.can_device_access_peer(self.device, peer):
            raise RuntimeError(f"{self.device} has no peer access to {peer}")
        here = torch.zeros(1, dtype=torch.uint8, device=self.device)
        there = torch.zeros(1, dtype=torch.uint8, device=peer)
        here.copy_(there)
        there.copy_(here)
        torch.cuda.synchronize(self.device)
        torch.cuda.synchronize(peer)


class OneShotAllReduce:
    """Sums a contiguous bf16/fp16/fp32 CUDA tensor over the ranks that built `IpcBuffers`
    together, in place. Every rank must make the same calls in the same order (message sizes
    included), as with any collective. `accepts(x)` says whether this message fits."""

    def __init__(self, buffers: IpcBuffers, max_spins: int = 1 << 26):
        self.buffers, self.max_spins = buffers, max_spins

    def accepts(self, x: torch.Tensor) -> bool:
        return ((x.is_cuda or _INTERPRET) and x.dtype in _ELEM and x.is_contiguous()
                and x.numel() * x.element_size() <= self.buffers.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.accepts(x):
            raise ValueError(f"one-shot all-reduce takes contiguous bf16/fp16/fp32 CUDA tensors "
                             f"of at most {self.buffers.max_bytes} bytes; got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        return self.launch(x)

    def launch(self, x: torch.Tensor) -> torch.Tensor:
        """`__call__` for a tensor `accepts` has already taken (the per-layer path)."""
        b = self.buffers
        n = x.numel()
        if n == 0:
            return x
        half = b.max_bytes // x.element_size()        # elements per staging half
        programs = min(MAX_PROGRAMS, triton.cdiv(n, BLOCK))
        _one_shot_kernel[(programs,)](x, b.buf_ptrs, b.flag_ptrs, b.gen, b.counter, b.err, n, half,
                                      b.rank, self.max_spins, WORLD=b.world, ELEM=_ELEM[x.dtype],
                                      SLOTS=MAX_PROGRAMS, BLOCK=BLOCK, num_warps=4)
        return x

    def check(self) -> None:
        """Raise if a wait ever gave up (synchronises the device)."""
        if int(self.buffers.err.item()):
            raise RuntimeError("one-shot all-reduce: a rank's wait for its peers timed out; the "
                               "results since are wrong (ranks out of step, or a peer died)")
