"""The one-shot all-reduce on the GPU, against the rank-ordered fp32 sum:
- two ranks as two streams of one process (the kernels of both run at once), eager and as
  CUDA graphs, many calls of changing sizes (both staging halves, the grid-stride loop);
- two processes sharing the one GPU through CUDA IPC, built as the engine builds it
  (`build_fast_all_reduce` over a gloo group). Kernels of two processes only progress by
  time-slicing there, so this one is slow; every wait is bounded."""
import os
import socket

import pytest
import torch

pytestmark = pytest.mark.gpu

from m3serve.kernels import allreduce as ar  # noqa: E402


def _in_process_ranks(world, max_bytes):
    bufs = [ar.IpcBuffers(r, world, max_bytes, torch.device("cuda")) for r in range(world)]
    ptrs = torch.tensor([b.staging.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")
    flags = torch.tensor([b.flags.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")
    for b in bufs:
        b.buf_ptrs, b.flag_ptrs = ptrs, flags
    return [ar.OneShotAllReduce(b, max_spins=1 << 22) for b in bufs]


def _sizes():
    # 1 token to 85 tokens of a 6144-wide bf16 message, and odd sizes
    return [6144, 4 * 6144, 1, 16 * 6144 + 3, 85 * 6144, 777]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_streams_of_one_process(world, dtype):
    max_bytes = 85 * 6144 * 4
    ranks = _in_process_ranks(world, max_bytes)
    streams = [torch.cuda.Stream() for _ in range(world)]
    g = torch.Generator(device="cuda").manual_seed(0)
    for it in range(3):
        for numel in _sizes():
            if numel * torch.finfo(dtype).bits // 8 > max_bytes:
                continue
            parts = [torch.randn(numel, device="cuda", generator=g).to(dtype) for _ in range(world)]
            xs = [p.clone() for p in parts]
            torch.cuda.synchronize()
            for r in range(world):
                with torch.cuda.stream(streams[r]):
                    ranks[r](xs[r])
            torch.cuda.synchronize()
            expect = ar.all_reduce_ref(parts)
            for r in range(world):
                assert torch.equal(xs[r], expect), (it, numel, r)
    for r in ranks:
        r.check()


def test_cuda_graphs_replay_with_fresh_inputs():
    world, numel = 2, 16 * 6144
    ranks = _in_process_ranks(world, numel * 2)
    streams = [torch.cuda.Stream() for _ in range(world)]
    xs = [torch.zeros(numel, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    for r in range(world):      # warm up (compiles) together, then capture each rank alone
        with torch.cuda.stream(streams[r]):
            ranks[r](xs[r])
    torch.cuda.synchronize()
    graphs = []
    for r in range(world):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams[r]):
            ranks[r](xs[r])
        graphs.append(graph)
    torch.cuda.synchronize()
    # capture ran nothing, so every rank's call counter is still in step
    g = torch.Generator(device="cuda").manual_seed(1)
    for it in range(5):
        parts = [torch.randn(numel, device="cuda", generator=g).to(torch.bfloat16) for _ in range(world)]
        for x, p in zip(xs, parts):
            x.copy_(p)
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        expect = ar.all_reduce_ref(parts)
        for r in range(world):
            assert torch.equal(xs[r], expect), (it, r)
    for r in ranks:
        r.check()


def _two_process_rank(rank, port, result_dir):
    import torch.distributed as dist

    from m3serve.distributed import build_fast_all_reduce
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        fast = build_fast_all_reduce(dist.group.WORLD, rank, 2, torch.device("cuda", 0), False,
                                     max_bytes=1 << 16)
        assert fast is not None, "the one-shot all-reduce was refused on one GPU"
        fast.max_spins = 1 << 30        # time-slicing: a wait may last a whole slice
        ok = []
        for it in range(6):
            numel = [1, 6144, 4099, 16384][it % 4]
            parts = [torch.arange(numel, device="cuda", dtype=torch.float32) * (r + 1) + it
                     for r in range(2)]
            x = parts[rank].clone()
            fast(x)
            ok.append(bool(torch.equal(x, ar.all_reduce_ref(parts))))
        fast.check()
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write(repr(ok))
    finally:
        dist.destroy_process_group()


def test_two_processes_on_one_gpu(tmp_path):
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_two_process_rank, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(2):
        assert (tmp_path / f"rank{r}").read_text() == repr([True] * 6)
