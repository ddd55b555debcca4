"""`bench make-realshape --tp-rank N [--ep]`: the one-GPU config of one TP-N rank builds exactly
the parameter shapes that rank 0 of the multi-process TP-N engine builds (gloo, N = 2, 4, 8, on
the tiny model widened so every width divides by 8), and an expert-parallel view computes only
the rows routed to its experts."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from m3serve.bench.realshape import rank_text_config
from m3serve.engine.engine_group import free_port
from m3serve.distributed import GroupInfo, ParallelInfo
from m3serve.model.config import parse_config
from m3serve.model.loader import load_model
from m3serve.model.tiny import tiny_config_dict


def _wide_tiny() -> dict:
    """The tiny config with 8 query heads, 8 experts and widths that split 8 ways."""
    raw = tiny_config_dict()
    raw["text_config"].update(num_attention_heads=8, intermediate_size=64, shared_intermediate_size=64,
                              dense_intermediate_size=128)
    return raw


def _write(path, raw: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


def _shapes(model) -> dict:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _rank_main(rank: int, world: int, port: int, model_dir: str, out_path: str):
    """One rank of the engine's layout over gloo: each layout's rank-0 parameter shapes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        shapes = {}
        for ep in (False, True):
            tp = GroupInfo(rank, world, dist.group.WORLD)
            model = load_model(model_dir, dtype="float32", load_format="dummy", progress=False,
                               parallel=ParallelInfo(tp, enable_expert_parallel=ep))[0]
            shapes[ep] = _shapes(model)
        if rank == 0:
            torch.save(shapes, out_path)
        # every rank past its last collective before any tears gloo down (a rank whose peer
        # closed its connections mid-teardown aborted: "terminate called without an active
        # exception", SIGABRT, once in CI)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_rank_config_builds_the_engine_rank_shapes(tmp_path, world):
    raw = _wide_tiny()
    full_dir = _write(tmp_path / "full", raw)
    out = tmp_path / "shapes.pt"
    mp.start_processes(_rank_main, args=(world, free_port(), full_dir, str(out)), nprocs=world,
                       start_method="spawn")
    engine = torch.load(out)
    for ep in (False, True):
        rank_raw = dict(raw, text_config=rank_text_config(raw["text_config"], world, ep))
        rank_dir = _write(tmp_path / f"rank{int(ep)}", rank_raw)
        model = load_model(rank_dir, dtype="float32", load_format="dummy", progress=False)[0]
        assert _shapes(model) == engine[ep], f"TP {world}, expert parallel {ep}"
    cfg = parse_config(dict(raw, text_config=rank_text_config(raw["text_config"], world)))
    assert cfg.vocab_size == -(-raw["text_config"]["vocab_size"] // world)


def test_rank_config_errors():
    text = _wide_tiny()["text_config"]
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by TP=3"):
        rank_text_config(text, 3)
    with pytest.raises(ValueError, match="num_local_experts=8 divisible by 16"):
        rank_text_config(dict(text, num_attention_heads=16, intermediate_size=64,
                              shared_intermediate_size=64, dense_intermediate_size=128), 16, True)
    bad = dict(text, expert_parallel_view={"rank": 2, "size": 2})
    with pytest.raises(ValueError, match="expert_parallel_view"):
        parse_config(bad)
    view = dict(text, expert_parallel_view={"rank": 0, "size": 2})
    with pytest.raises(ValueError, match="one rank's view of expert parallelism"):
        from m3serve.layers.moe import MoE
        MoE(parse_config(view), ParallelInfo(GroupInfo(0, 2)), torch.float32, layer_id=1)


def test_expert_view_computes_only_its_experts(tmp_path):
    """The expert-parallel views of ranks 0..n-1 (same dummy weights as the whole model) each
    give the routed sum over their own experts only: together, the whole model's routed sum."""
    raw = _wide_tiny()
    full = load_model(_write(tmp_path / "full", raw), dtype="float32", load_format="dummy",
                      progress=False)[0]
    x = torch.randn(6, raw["text_config"]["hidden_size"], generator=torch.Generator().manual_seed(3))
    layer = 2                                        # an MoE layer of the tiny schedule
    want = full.model.layers[layer].mlp._routed(x, fold_shared=False)
    parts = []
    for rank in range(4):
        text = dict(raw["text_config"], expert_parallel_view={"rank": rank, "size": 4})
        view = load_model(_write(tmp_path / f"view{rank}", dict(raw, text_config=text)),
                          dtype="float32", load_format="dummy", progress=False)[0]
        moe = view.model.layers[layer].mlp
        assert moe.experts.w13.shape[0] == 2 and moe.experts.first == 2 * rank
        parts.append(moe._routed(x, fold_shared=False))
    assert not torch.equal(parts[0], torch.zeros_like(parts[0]))
    assert not torch.equal(parts[0], want)
    torch.testing.assert_close(sum(parts), want, rtol=1e-5, atol=1e-6)
