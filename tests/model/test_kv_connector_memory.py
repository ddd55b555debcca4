"""A third KV tier through the connector interface alone (tests/model/memory_connector.py): two
engines on the tiny model share an in-memory block store; what one stores, the other loads
instead of computing, and its greedy tokens are those of an engine without the tier. Corrupting
the stored blocks changes them (the loaded KV is really used); an abort during a load frees
everything once the load is over."""
import torch
from memory_connector import MemoryStore, MemoryTierScheduler, MemoryTierWorker

from m3serve.config import EngineConfig
from m3serve.engine.engine_core import EngineCore
from m3serve.core.request import Request, RequestStatus
from m3serve.executor.uniproc import UniProcExecutor
from m3serve.sampling_params import SamplingParams

FLAGS = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def ids(n, seed):
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(tiny_dir, store=None) -> EngineCore:
    config = EngineConfig.from_kwargs(model=str(tiny_dir), **FLAGS)
    executor = UniProcExecutor(config, tiny_dir, progress=False)
    if store is None:
        return EngineCore(config, executor)
    core = EngineCore(config, executor,
                      lambda config, executor, kv_manager: [MemoryTierScheduler(store, executor.geometry().block_size)])
    executor.worker.kv_connector = MemoryTierWorker(store, executor.worker.cache_planes())
    return core


def run(core: EngineCore, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    for rid, prompt in prompts.items():
        core.add_request(Request(rid, prompt, GREEDY.clone(), eos_token_id=None))
    tokens = {rid: [] for rid in prompts}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    core.scheduler.check_integrity()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_usable_blocks
    return tokens


def test_a_third_tier_needs_no_scheduler_change(tiny_dir):
    first = ids(70, 1)
    prompts = {"a": first + ids(9, 2), "b": ids(40, 3) + ids(5, 4)}
    want = run(engine(tiny_dir), prompts)

    store = MemoryStore()
    writer = engine(tiny_dir, store)
    run(writer, {"first": first})
    tier = writer.scheduler.connector
    assert tier.stats.blocks_stored == 4 and tier.stats.blocks_loaded == 0     # 70 tokens: 4 full blocks
    assert len(store.data) == 4

    reader = engine(tiny_dir, store)
    got = run(reader, prompts)
    assert got == want
    stats = reader.scheduler.connector.stats
    assert stats.loads_done == 1 and stats.blocks_loaded == 4 and stats.hit_tokens == 64
    assert reader.scheduler.num_kv_loads == 1 and reader.kv_manager.prefix_cache_hits == 0

    for planes in store.data.values():               # the loaded KV is what the reader used
        for t in planes:
            t.mul_(-1)
    assert run(engine(tiny_dir, store), prompts)["a"] != want["a"]


def test_abort_during_a_load_frees_everything(tiny_dir):
    store = MemoryStore()
    first = ids(70, 5)
    run(engine(tiny_dir, store), {"first": first})
    core = engine(tiny_dir, store)
    core.add_request(Request("r", first + ids(6, 6), GREEDY.clone(), eos_token_id=None))
    so = core.scheduler.schedule()
    (request, _, num_computed), = core.scheduler.kv_waiting.values()
    assert request.status == RequestStatus.WAITING_FOR_KV and num_computed == 64
    assert len(so.kv_connector_metadata["memory"].load_keys) == 4
    blocks = core.kv_manager.get_block_ids("r")
    core.abort_requests(["r"])
    assert core.kv_manager.get_block_ids("r") == blocks          # held until the load is over
    core.execute(so)
    assert not core.scheduler.kv_waiting and not core.kv_manager.has_blocks("r")
    while core.has_unfinished_requests():
        core.step()
    core.scheduler.check_integrity()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_usable_blocks
