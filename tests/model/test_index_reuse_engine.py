"""Cross-layer top-k reuse end to end on the tiny model: the engine's greedy tokens equal the
dense reference that skips the indexer the same way, under chunked prefill and a prefix hit
(which needs no index keys of the skipping layers: they have no index cache), with the pool
sized for the indexer layers' caches only; and TP 2 (index heads split over the ranks, each rank
handing its own heads' selection to its skipping layers) gives one process's logits."""
import os

import torch
import torch.multiprocessing as mp
import torch.distributed as dist

from m3serve.engine.engine_group import free_port
from m3serve.llm import LLM
from m3serve.model.loader import load_model
from m3serve.model.reference import ReferenceM3
from paged import PagedRunner
from refgreedy import canonical_weights, greedy_after_shared_prefix, reference_greedy

REUSE = {"text_config": {"use_index_cache": True, "index_topk_freq": 2}}    # layers 1 and 3 index


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_engine_greedy_equals_reference_chunked_and_prefix_hit(tiny_dir):
    cfg = load_model(tiny_dir, dtype="float32", progress=False, hf_overrides=REUSE)[1]
    ref = ReferenceM3(cfg, canonical_weights(tiny_dir))
    shared = _ids(70, 11)
    a, b = shared + _ids(25, 12), shared + _ids(40, 13)
    want = [reference_greedy(ref, p, 6) for p in (a, b)]
    # fp32 bytes per token: 5 layers of K+V (2 x 2 heads x 32 x 4 B) + 2 indexer layers' keys
    # (32 x 4 B) = 2816 B (3 index layers without reuse: 2944 B, 19 blocks)
    llm = LLM(model=str(tiny_dir), dtype="float32", max_num_batched_tokens=24, hf_overrides=REUSE,
              kv_cache_memory=20 * 16 * 2816)
    assert llm.engine.worker.num_blocks == 20
    assert [c is not None for c in llm.engine.worker.runner.index_caches] == [False, True, False, True, False]
    assert greedy_after_shared_prefix(llm, a, b, chunk=24) == want


def _steps(runner, ids):
    return torch.cat([runner.step({0: ids[:90]}), runner.step({0: ids[90:]}), runner.step({0: [11]})])


def _rank_main(rank: int, world: int, port: int, model_dir: str, ids: list[int], out_path: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import sys
        sys.path.insert(0, os.path.dirname(__file__))
        from m3serve.distributed import GroupInfo, ParallelInfo

        tp = GroupInfo(rank, world, dist.group.WORLD)
        model, _, _ = load_model(model_dir, dtype="float32", parallel=ParallelInfo(tp), progress=False,
                                 hf_overrides=REUSE)
        assert model.attention_layers[1].indexer is not None and model.attention_layers[1].num_kv_heads == 1
        logits = _steps(PagedRunner(model), ids)
        if rank == 0:
            torch.save(logits, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tp2_logits_equal_single_process(tiny_dir, tmp_path):
    ids = _ids(130, 21)
    model, _, _ = load_model(tiny_dir, dtype="float32", progress=False, hf_overrides=REUSE)
    want = _steps(PagedRunner(model), ids)
    exact = _steps(PagedRunner(load_model(tiny_dir, dtype="float32", progress=False)[0]), ids)
    assert not torch.allclose(want, exact, atol=1e-3)        # the reuse changes this computation
    out = tmp_path / "tp_logits.pt"
    mp.start_processes(_rank_main, args=(2, free_port(), str(tiny_dir), ids, str(out)),
                       nprocs=2, start_method="spawn")
    got = torch.load(out)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
