"""Which all-reduce a TP group uses: the one-shot IPC kernel for messages it accepts, the
group's backend (NCCL, gloo) for the rest, and the backend alone where the kernel cannot run."""
import torch
import torch.distributed as dist

from m3serve import distributed as d
from m3serve.config import ParallelConfig


class _Fast:
    def __init__(self, max_numel):
        self.max_numel, self.calls = max_numel, []

    def accepts(self, x):
        return x.numel() <= self.max_numel

    def launch(self, x):
        self.calls.append(x.numel())
        return x.mul_(10)


def test_small_messages_take_the_kernel_and_large_ones_the_backend(monkeypatch):
    backend = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: backend.append(x.numel()))
    fast = _Fast(max_numel=64)
    g = d.GroupInfo(0, 2, group=object(), fast=fast)
    small, large = torch.ones(64), torch.ones(65)
    assert g.all_reduce(small) is small and torch.equal(small, torch.full((64,), 10.0))
    g.all_reduce(large)
    assert fast.calls == [64] and backend == [65]
    # one rank, or no group: nothing at all
    d.GroupInfo(0, 1, group=object(), fast=fast).all_reduce(small)
    d.GroupInfo(0, 2, fast=fast).all_reduce(small)
    assert fast.calls == [64] and backend == [65]
    # no kernel: the backend for everything
    d.GroupInfo(0, 2, group=object()).all_reduce(small)
    assert backend == [65, 64]


def test_refusals_name_their_reason():
    cuda = torch.device("cuda", 0)
    assert d.custom_all_reduce_refusal(cuda, 2, disabled=True) == "--disable-custom-all-reduce"
    assert "CUDA" in d.custom_all_reduce_refusal(torch.device("cpu"), 2, disabled=False)
    assert "one rank" in d.custom_all_reduce_refusal(cuda, 1, disabled=False)
    assert "at most 8" in d.custom_all_reduce_refusal(cuda, 16, disabled=False)
    assert d.custom_all_reduce_refusal(cuda, 8, disabled=False) is None
    # on a CPU rank nothing is built and no collective is entered (group None would fail)
    assert d.build_fast_all_reduce(None, 0, 2, torch.device("cpu"), disabled=False) is None


def test_flag_is_vllms():
    import argparse

    from m3serve.engine_args import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--disable-custom-all-reduce"]))["disable_custom_all_reduce"]
    assert not ParallelConfig().disable_custom_all_reduce


def test_the_flag_reaches_the_rank_groups(monkeypatch):
    """--disable-custom-all-reduce travels from the engine config to the groups each rank
    builds (whose TP group then takes NCCL alone: `custom_all_reduce_refusal`)."""
    from m3serve.config import EngineConfig
    from m3serve.executor import rank as rank_mod
    seen = {}
    monkeypatch.setattr(rank_mod, "init_rank_groups", lambda *a: seen.setdefault("args", a))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    for disabled in (True, False):
        seen.clear()
        config = EngineConfig.from_kwargs(model=None, device="cpu", disable_custom_all_reduce=disabled)
        rank_mod.join_world(config, 0, 29999)
        assert seen["args"][-1] is disabled
    # and a refused group builds nothing, on any device, without entering a collective
    assert d.build_fast_all_reduce(None, 0, 2, torch.device("cuda", 0), disabled=True) is None
