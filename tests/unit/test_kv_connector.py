"""The KV-connector lane in the scheduler, with two test connectors composed (`MultiConnectorScheduler`)
over the shadow-KV fake model: each holds whole blocks (their token ids) by content hash; one is
an optional tier, the other a required source whose loads may fail or be aborted. The first
connector that answers owns a request's load; a landed load is used (tokens equal the
reference model's), a failed one is recomputed, an aborted one frees its blocks only once over,
and the books stay consistent every step."""
import msgspec
import pytest
from test_scheduler import FakeRunner, Params, reference

from m3serve.config import SchedulerConfig
from m3serve.core.kv_cache.manager import KVCacheManager
from m3serve.core.kv_connector import ExternalHit, KVConnectorScheduler, MultiConnectorScheduler
from m3serve.core.request import Request, RequestStatus
from m3serve.core.scheduler import Scheduler

BS = 4


class Loads(msgspec.Struct):
    jobs: list[tuple[str, list[bytes], list[int]]] = []


class ShadowConnector(KVConnectorScheduler):
    """Blocks by hash in `store`; a load is over `delay` steps after it was sent (or fails)."""

    def __init__(self, name, store, optional=True, delay=1):
        self.name, self.store, self.optional, self.delay = name, store, optional, delay
        self.fail: set[str] = set()
        self.aborted: list[str] = []
        self.failed: set[str] = set()
        self.loads_started = self.loads_landed = 0
        self._answer = None
        self._to_send: list = []
        self._sent: dict[str, int] = {}          # request id -> steps left
        self._over: list = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens, hit_blocks, count=True):
        if request.request_id in self.failed:
            return None                           # computed here after a failure, not tried again
        keys = []
        for key in request.block_hashes[len(hit_blocks):(request.num_tokens - 1) // BS]:
            if key not in self.store:
                break
            keys.append(key)
        if not keys:
            return None
        self._answer = (request.request_id, keys)
        return ExternalHit(len(keys) * BS, optional=self.optional)

    def start_load(self, request, block_ids, num_computed_tokens):
        rid, keys = self._answer
        first = num_computed_tokens // BS
        self._to_send.append((rid, keys, block_ids[first:first + len(keys)]))
        self.loads_started += 1

    def build_metadata(self):
        if not (self._to_send or self._sent):
            return None
        meta, self._to_send = Loads(self._to_send), []
        for rid, _, _ in meta.jobs:
            self._sent[rid] = self.delay
        return meta

    def update(self, reports):
        for rid in list(self._sent):
            self._sent[rid] -= 1
            if self._sent[rid] <= 0:
                del self._sent[rid]
                self._over.append((rid, "injected" if rid in self.fail else None))

    def take_finished_loads(self):
        out, self._over = self._over, []
        self.loads_landed += sum(f is None for _, f in out)
        return out

    def on_load_end(self, request, failure):
        if failure is not None:
            self.failed.add(request.request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)

    @property
    def has_pending(self):
        return bool(self._to_send or self._sent or self._over)


def run_step(sched, runner, connectors):
    so = sched.schedule()
    meta = so.kv_connector_metadata or {}
    for name, loads in meta.items():
        for rid, keys, block_ids in loads.jobs:
            if rid not in connectors[name].fail:
                for key, block_id in zip(keys, block_ids):
                    runner.cache[block_id] = list(connectors[name].store[key])
    out = runner.execute(so)
    if meta:
        sched.update_kv_connectors({name: [None] for name in meta})
    outputs = sched.update_from_output(so, out)
    sched.check_integrity()
    return so, outputs


def blocks_of(prompt):
    """The shadow blocks of a prompt's full blocks, by hash (what a store would hold)."""
    kv = KVCacheManager(64, BS)
    r = Request("x", prompt, Params(max_tokens=1), None)
    kv.get_computed_blocks(r)
    return {h: prompt[i * BS:(i + 1) * BS] for i, h in enumerate(r.block_hashes)}


@pytest.fixture
def lane():
    tier = ShadowConnector("tier", {})
    remote = ShadowConnector("remote", {}, optional=False, delay=3)
    kv = KVCacheManager(64, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv, 256,
                      kv_connector=MultiConnectorScheduler([remote, tier]))
    return sched, FakeRunner(BS), {"tier": tier, "remote": remote}


def drive(sched, runner, connectors, requests):
    for r in requests:
        sched.add_request(r)
    got = {r.request_id: [] for r in requests}
    for _ in range(100):
        _, outputs = run_step(sched, runner, connectors)
        for o in outputs:
            got[o.request_id] += o.new_token_ids
        if not sched.has_unfinished_requests() and not sched.has_kv_transfer_work:
            break
    assert sched.kv_manager.num_free_blocks == sched.kv_manager.num_usable_blocks
    return got


def test_each_connector_lands_what_it_holds(lane):
    sched, runner, c = lane
    a, b = list(range(1, 20)), list(range(50, 67))
    c["tier"].store.update(blocks_of(a))
    c["remote"].store.update(blocks_of(b))
    requests = [Request("a", a, Params(max_tokens=5), None), Request("b", b, Params(max_tokens=5), None)]
    got = drive(sched, runner, c, requests)
    assert got == {"a": reference(a, 5), "b": reference(b, 5)}
    assert (c["tier"].loads_landed, c["remote"].loads_landed) == (1, 1) and sched.num_kv_loads == 2
    assert [r.num_cached_tokens for r in requests] == [16, 16]      # admitted with 4 loaded blocks
    assert sched.kv_manager.prefix_cache_hits == 0


@pytest.mark.parametrize("name", ["tier", "remote"])
def test_the_loaded_blocks_are_what_the_model_reads(lane, name):
    sched, runner, c = lane
    a = list(range(1, 20))
    c[name].store.update({h: [t + 1 for t in block] for h, block in blocks_of(a).items()})   # wrong KV
    got = drive(sched, runner, c, [Request("a", a, Params(max_tokens=5), None)])
    assert c[name].loads_landed == 1 and got["a"] != reference(a, 5)


def test_the_first_connector_that_answers_owns_the_load(lane):
    sched, runner, c = lane
    a = list(range(1, 20))
    c["tier"].store.update(blocks_of(a))
    c["remote"].store.update(blocks_of(a))
    got = drive(sched, runner, c, [Request("a", a, Params(max_tokens=3), None)])
    assert got == {"a": reference(a, 3)}
    assert (c["remote"].loads_started, c["tier"].loads_started) == (1, 0)


def test_a_failed_load_is_recomputed(lane):
    sched, runner, c = lane
    a = list(range(3, 25))
    c["remote"].store.update(blocks_of(a))
    c["remote"].fail.add("a")
    got = drive(sched, runner, c, [Request("a", a, Params(max_tokens=4), None)])
    assert got == {"a": reference(a, 4)} and c["remote"].loads_landed == 0
    assert c["remote"].failed == {"a"} and c["remote"].loads_started == 1
    assert sched.requests == {} and not sched.kv_waiting


@pytest.mark.parametrize("name", ["tier", "remote"])
def test_abort_while_loading_frees_blocks_when_the_load_is_over(lane, name):
    sched, runner, c = lane
    a = list(range(5, 30))
    c[name].store.update(blocks_of(a))
    c[name].delay = 4
    sched.add_request(Request("a", a, Params(max_tokens=4), None))
    run_step(sched, runner, c)
    (request, _, _), = sched.kv_waiting.values()
    assert request.status == RequestStatus.WAITING_FOR_KV
    sched.abort_requests(["a"])
    assert c[name].aborted == ["a"] and sched.kv_manager.has_blocks("a")
    for _ in range(2):
        run_step(sched, runner, c)
        assert sched.kv_manager.has_blocks("a")          # the load may still write there
    for _ in range(3):
        run_step(sched, runner, c)
    assert not sched.kv_waiting and not sched.kv_manager.has_blocks("a")
    assert sched.kv_manager.num_free_blocks == sched.kv_manager.num_usable_blocks
