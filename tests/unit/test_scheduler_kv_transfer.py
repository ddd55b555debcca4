"""P/D at the scheduler level: a producer and a consumer scheduler with their real connector
halves (side channel over loopback ZMQ), and shadow-KV fake runners; a pull copies the
producer's shadow blocks into the consumer's, so wrong block ids change the tokens.

Checked: the decode side generates what one engine would; the producer holds blocks until
released, claimed or timed out; failures fall back to recomputing (or fail the request with
kv_load_failure_policy "fail"); aborts at every stage free blocks on both sides only when
nothing can still write into them; the books stay consistent at every step.
"""
import gc
import json
import logging
import time

import pytest
from test_scheduler import FakeRunner, Params, reference

from m3serve.config import KVTransferConfig, SchedulerConfig
from m3serve.core.kv_cache.manager import KVCacheManager
from m3serve.core.request import Request, RequestStatus
from m3serve.core.scheduler import Scheduler
from m3serve.core.scheduler_output import ModelRunnerOutput
from m3serve.disagg.connector import KVTransferScheduler
from m3serve.disagg.messages import RankMetadata, RankResult, Region
from m3serve.kv_transfer_params import parse_kv_transfer_params

BS, NB = 4, 48
REGIONS = [Region("0.k", 0, 64, 16, 8, 0, 2, 2), Region("0.v", 4096, 64, 16, 8, 0, 2, 2)]


def node(role, tp=1, **extra):
    cfg = KVTransferConfig(json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                       "kv_connector_extra_config": extra}))
    ranks = [RankMetadata(r, f"{role}-{r}", b"", "DRAM", 0, REGIONS) for r in range(tp)]
    connector = KVTransferScheduler(cfg, BS, NB, ranks)
    kv = KVCacheManager(NB, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv, 256, kv_connector=connector)
    return sched, FakeRunner(BS)


@pytest.fixture
def pair():
    made = []

    def make(consumer_tp=1, **consumer_extra):
        p, d = node("kv_producer", abort_request_timeout=30), node("kv_consumer", consumer_tp, **consumer_extra)
        made.extend([p[0], d[0]])
        return p, d

    yield make
    for s in made:
        s.connector.shutdown()


class Worker:
    """Runs the fake runner and the fake ranks' pulls (copying the producer's shadow blocks)."""

    def __init__(self, sched, runner, source=None, tp=1, verdict="done"):
        self.sched, self.runner, self.source, self.tp, self.verdict = sched, runner, source, tp, verdict
        self.outputs = []
        self.jobs = []          # pulls in flight
        self.all_jobs = []

    def step(self):
        so = self.sched.schedule()
        out = self.runner.execute(so)
        meta = (so.kv_connector_metadata or {}).get("nixl")
        if meta is not None:
            for job in meta.recv:
                self.jobs.append(job)
                self.all_jobs.append(job)
                for local, remote in zip(job.local_block_ids, job.remote_block_ids):
                    self.runner.cache[local] = list(self.source.cache[remote])
            if meta.poll:
                report = RankResult(done=[], failed={})
                if self.verdict != "hang":
                    for job in self.jobs:
                        if self.verdict == "done":
                            report.done.append(job.request_id)
                        else:
                            report.failed[job.request_id] = "injected"
                    self.jobs = []
                out.kv_connector_output = {"nixl": [report] * self.tp}
        if out.kv_connector_output is not None:
            self.sched.update_kv_connectors(out.kv_connector_output)
        self.outputs += self.sched.update_from_output(so, out)
        self.sched.check_integrity()
        return so

    def run_until(self, cond, timeout=10.0):
        deadline = time.time() + timeout
        while not cond():
            assert time.time() < deadline, "timed out"
            self.step()
            time.sleep(0.002)


def prefill(p_sched, p_runner, rid, prompt):
    w = Worker(p_sched, p_runner)
    p_sched.add_request(Request(rid, prompt, Params(max_tokens=1), None,
                                kv_transfer_params=parse_kv_transfer_params({"do_remote_decode": True})))
    w.run_until(lambda: any(o.finished for o in w.outputs))
    [out] = [o for o in w.outputs if o.finished]
    assert out.kv_transfer_params is not None and rid in p_sched.held
    return out.kv_transfer_params


def decode_request(rid, prompt, params, max_tokens=6):
    return Request(rid, prompt, Params(max_tokens=max_tokens), None,
                   kv_transfer_params=parse_kv_transfer_params(params))


def tokens_of(worker, rid):
    return [t for o in worker.outputs if o.request_id == rid for t in o.new_token_ids]


def test_decode_side_generates_what_one_engine_would(pair):
    (ps, pr), (ds, dr) = pair()
    prompt = list(range(1, 23))                       # 22 tokens: 6 blocks, the last one partial
    params = prefill(ps, pr, "p1", prompt)
    assert len(params["remote_block_ids"]) == 6
    free_before = ds.kv_manager.num_free_blocks
    ds.add_request(decode_request("d1", prompt, params))
    d = Worker(ds, dr, source=pr)
    so = d.step()                                      # blocks given, claim sent: nothing runs yet
    assert not so.num_scheduled_tokens and "d1" in ds.kv_waiting
    assert ds.connector.pulls_in_flight          # claiming counts: the engine polls at its TTFT pace
    assert ds.kv_manager.num_free_blocks == free_before - 6   # KV of 21 tokens
    d.run_until(lambda: any(o.finished for o in d.outputs))
    assert tokens_of(d, "d1") == reference(prompt, 6)
    assert ds.connector.stats.pulls_done == 1 and ds.connector.stats.fallbacks == 0
    # the producer frees its copy once the consumer releases it
    pw = Worker(ps, pr)
    pw.run_until(lambda: not ps.held)
    assert ps.kv_manager.num_free_blocks == NB - 1 and ps.connector.stats.holds_released == 1
    assert ds.kv_manager.num_free_blocks == NB - 1


def test_decode_step_is_a_one_token_prefill(pair):
    (ps, pr), (ds, dr) = pair()
    prompt = list(range(5, 18))
    params = prefill(ps, pr, "p1", prompt)
    ds.add_request(decode_request("d1", prompt, params, max_tokens=2))
    d = Worker(ds, dr, source=pr)
    news = []
    while not news:
        news = d.step().scheduled_new_reqs
    [new] = news
    assert new.num_computed_tokens == len(prompt) - 1 and d.sched.kv_manager.get_block_ids("d1") == new.block_ids
    assert len(new.block_ids) == -(-len(prompt) // BS)     # the pulled tokens are not counted twice


def test_prefix_hit_on_the_consumer_pulls_only_the_rest(pair):
    (ps, pr), (ds, dr) = pair()
    prompt = list(range(40, 70))
    d = Worker(ds, dr, source=pr)
    ds.add_request(Request("local", prompt, Params(max_tokens=1), None))     # warm the consumer's cache
    d.run_until(lambda: any(o.finished for o in d.outputs))
    params = prefill(ps, pr, "p1", prompt)
    ds.add_request(decode_request("d1", prompt, params))
    d.run_until(lambda: any(o.finished and o.request_id == "d1" for o in d.outputs))
    assert tokens_of(d, "d1") == reference(prompt, 6)
    [job] = d.all_jobs                   # 28 of the 29 tokens with KV were cached: one block moved
    assert job.remote_block_ids == params["remote_block_ids"][7:8] and len(job.local_block_ids) == 1


def test_stale_params_fall_back_to_recompute(pair):
    (ps, pr), (ds, dr) = pair()
    prompt = list(range(3, 20))
    params = prefill(ps, pr, "p1", prompt)
    ps.connector._released.append("p1")          # the producer lets go before the consumer asks
    Worker(ps, pr).step()
    assert not ps.held
    ds.add_request(decode_request("d1", prompt, params))
    d = Worker(ds, dr, source=pr)
    d.run_until(lambda: any(o.finished for o in d.outputs))
    assert tokens_of(d, "d1") == reference(prompt, 6)
    assert ds.connector.stats.fallbacks == 1 and ds.connector.stats.pulls_failed == 1 and not d.all_jobs


def test_a_failed_pull_recomputes_or_fails(pair):
    (ps, pr), (ds, dr) = pair()
    prompt = list(range(9, 30))
    params = prefill(ps, pr, "p1", prompt)
    ds.add_request(decode_request("d1", prompt, params))
    d = Worker(ds, dr, source=pr, verdict="fail")
    d.run_until(lambda: any(o.finished for o in d.outputs))
    assert tokens_of(d, "d1") == reference(prompt, 6) and ds.connector.stats.fallbacks == 1
    Worker(ps, pr).run_until(lambda: not ps.held)      # released although the pull failed

    (ps, pr), (ds, dr) = pair()
    object.__setattr__(ds.connector.config, "kv_load_failure_policy", "fail")
    params = prefill(ps, pr, "p2", prompt)
    ds.add_request(decode_request("d2", prompt, params))
    d = Worker(ds, dr, source=pr, verdict="fail")
    d.run_until(lambda: any(o.finished for o in d.outputs))
    [out] = d.outputs
    assert out.finish_reason == "error" and "injected" in out.error
    assert ds.kv_manager.num_free_blocks == NB - 1 and not ds.requests


def test_every_consumer_rank_must_report(pair):
    (ps, pr), (ds, dr) = pair(consumer_tp=2)
    prompt = list(range(9, 30))
    params = prefill(ps, pr, "p1", prompt)
    ds.add_request(decode_request("d1", prompt, params))
    d = Worker(ds, dr, source=pr, tp=2, verdict="hang")
    d.run_until(lambda: d.jobs)
    so = ds.schedule()
    ds.update_kv_connectors({"nixl": [RankResult(done=["d1"]), RankResult()]})
    ds.update_from_output(so, ModelRunnerOutput([], []))   # rank 1 is still pulling
    assert "d1" in ds.kv_waiting and ds.connector.stats.pulls_done == 0
    so = ds.schedule()
    ds.update_kv_connectors({"nixl": [RankResult(), RankResult(failed={"d1": "x"})]})
    ds.update_from_output(so, ModelRunnerOutput([], []))
    ds.schedule()
    assert "d1" not in ds.kv_waiting and ds.connector.stats.fallbacks == 1   # one rank failed: recompute


@pytest.mark.parametrize("stage", ["claiming", "reading"])
def test_abort_while_pulling_frees_blocks_only_when_the_pull_is_over(pair, stage):
    (ps, pr), (ds, dr) = pair()
    prompt = list(range(11, 40))
    params = prefill(ps, pr, "p1", prompt)
    ds.add_request(decode_request("d1", prompt, params))
    d = Worker(ds, dr, source=pr, verdict="hang")
    d.step()
    if stage == "reading":
        d.run_until(lambda: d.jobs)
    ds.abort_requests(["d1"])
    assert "d1" not in ds.requests and ds.kv_manager.has_blocks("d1")   # something may still write there
    if stage == "reading":
        for _ in range(5):
            d.step()
        assert ds.kv_manager.has_blocks("d1")
        d.verdict = "done"
    d.run_until(lambda: not ds.kv_waiting)
    assert ds.kv_manager.num_free_blocks == NB - 1
    Worker(ps, pr).run_until(lambda: not ps.held)
    assert ps.kv_manager.num_free_blocks == NB - 1


def test_unpulled_holds_expire():
    ps, pr = node("kv_producer", abort_request_timeout=0.2)
    try:
        prefill(ps, pr, "p1", list(range(1, 14)))
        assert ps.kv_manager.num_free_blocks < NB - 1
        Worker(ps, pr).run_until(lambda: not ps.held, timeout=5)
        assert ps.kv_manager.num_free_blocks == NB - 1 and ps.connector.stats.holds_expired == 1
    finally:
        ps.connector.shutdown()


def test_requests_need_the_matching_role(pair):
    (ps, pr), (ds, dr) = pair()
    with pytest.raises(ValueError, match="not a KV consumer"):
        ps.add_request(decode_request("x", [1, 2], {"do_remote_prefill": True, "remote_block_ids": [1],
                                                    "remote_engine_id": "e", "remote_request_id": "r",
                                                    "remote_host": "h", "remote_port": 1}))
    with pytest.raises(ValueError, match="not a KV producer"):
        ds.add_request(Request("y", [1, 2], Params(max_tokens=1), None,
                               kv_transfer_params=parse_kv_transfer_params({"do_remote_decode": True})))
    plain = Scheduler(SchedulerConfig(), KVCacheManager(8, BS), 64)
    with pytest.raises(ValueError, match="kv_role: none"):
        plain.add_request(Request("z", [1, 2], Params(max_tokens=1), None,
                                  kv_transfer_params=parse_kv_transfer_params({"do_remote_decode": True})))


def test_a_finished_prefill_that_stopped_early_is_not_held(pair):
    (ps, pr), _ = pair()
    w = Worker(ps, pr)
    ps.add_request(Request("p1", [1, 2, 3], Params(max_tokens=4, stop_token_ids=[reference([1, 2, 3], 1)[0]]),
                           None, kv_transfer_params=parse_kv_transfer_params({"do_remote_decode": True})))
    w.run_until(lambda: any(o.finished for o in w.outputs))
    assert w.outputs[-1].kv_transfer_params is None and not ps.held
    assert ps.kv_manager.num_free_blocks == NB - 1


def test_producer_books_keep_nothing_per_request(caplog):
    """Many prefills held for a decode worker, each then pulled and released, released without
    a pull, or left to expire: the producer's books (held requests, holds, releases) empty out
    and the Python memory they use (tracemalloc, side-channel thread included) does not grow
    by more than a few dozen bytes per request between two checkpoints after a warm-up; a
    record kept per request (~200 bytes, as the API-process soak of issue 32 measured) fails."""
    import tracemalloc

    from m3serve.disagg.messages import Release

    # long enough that a pull on a loaded 2-core machine (tracemalloc on) never outlives its hold
    ps, pr = node("kv_producer", abort_request_timeout=1.5)
    ds, dr = node("kv_consumer")
    prompt = list(range(1, 14))

    def cycle(start: int, count: int) -> None:
        expiring = []
        for i in range(start, start + count):
            params = prefill(ps, pr, f"p{i}", prompt)
            if i % 3 == 0:                       # the decode worker pulls the KV, then releases it
                ds.add_request(decode_request(f"d{i}", prompt, params, max_tokens=1))
                d = Worker(ds, dr, source=pr)
                d.run_until(lambda d=d: any(o.finished for o in d.outputs))
            elif i % 3 == 1:                     # released unpulled (the consumer had a prefix hit)
                assert ps.connector._handle(Release(ps.connector.engine_id, [f"p{i}"])).ok
            else:
                expiring.append(f"p{i}")         # nobody comes: the hold timeout frees it
        Worker(ps, pr).run_until(lambda: not ps.held, timeout=10)
        Worker(ds, dr).run_until(lambda: not ds.has_kv_transfer_work, timeout=10)

    # pytest keeps every log record it captures: the expiry warnings would read as growth
    caplog.set_level(logging.ERROR, logger="m3serve.disagg.connector")
    try:
        tracemalloc.start()
        num_requests = 300
        # a warm-up as large as a hold timeout's worth of requests, so that the books' dicts have
        # reached their high-water size (a dict keeps its capacity) before the first checkpoint
        cycle(0, 150)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        cycle(150, num_requests)
        gc.collect()
        growth = (tracemalloc.get_traced_memory()[0] - before) / num_requests
        print(f"producer books: {growth:.1f} bytes per request over {num_requests} requests")
        connector = ps.connector
        assert not ps.held and not ps.requests and not connector._holds and not connector._released
        assert connector.stats.held_requests == 0 and connector.stats.held_blocks == 0
        assert connector.stats.holds_expired == 150 and connector.stats.holds_released == 300
        assert ps.kv_manager.num_free_blocks == NB - 1 and ds.kv_manager.num_free_blocks == NB - 1
        assert growth < 64, f"{growth:.0f} bytes per request"
    finally:
        tracemalloc.stop()
        ps.connector.shutdown()
        ds.connector.shutdown()
