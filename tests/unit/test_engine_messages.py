"""What crosses between the engine processes and the API: the stats of DP replicas combined
(counts summed, histograms by bucket, KV usage over the summed pools), and a message that does
not decode."""
from m3serve.engine.engine_group import ReplicaBook
from m3serve.protocol import ITERATION_TOKEN_BUCKETS, EngineStats


def test_replica_stats_combine():
    n = len(ITERATION_TOKEN_BUCKETS) + 1
    a = EngineStats(num_running=2, num_free_blocks=10, num_usable_blocks=40, num_steps=5,
                    iteration_token_counts=[1] + [0] * (n - 2) + [2], iteration_tokens_sum=70000)
    b = EngineStats(num_running=3, num_free_blocks=30, num_usable_blocks=40, num_steps=7,
                    iteration_token_counts=[0, 4] + [0] * (n - 2), iteration_tokens_sum=20)
    total = ReplicaBook.combine([a, b])
    assert (total.num_running, total.num_steps) == (5, 12)
    assert total.iteration_token_counts == [1, 4] + [0] * (n - 3) + [2]
    assert total.iteration_tokens_sum == 70020
    assert total.kv_cache_usage == 1.0 - 40 / 80


def test_an_admission_that_does_not_decode_is_refused_alone():
    """A message the engine cannot decode (a type the API should have refused) answers its
    admission with an error instead of stopping the engine loop."""
    import msgspec

    from m3serve.engine.engine_proc import _decode_or_refuse
    from m3serve.protocol import AbortRequests, encode

    raw = {"type": "add", "parent_id": "p1", "requests": [{"request_id": 5}]}   # wrong types
    results = []
    assert _decode_or_refuse(msgspec.msgpack.encode(raw), results) is None
    assert [(r.parent_id, r.kind) for r in results] == [("p1", "error")]
    assert "could not decode" in results[0].message
    assert _decode_or_refuse(b"\xc1 not msgpack", results) is None and len(results) == 1
    good = _decode_or_refuse(encode(AbortRequests(["a"])), results)
    assert isinstance(good, AbortRequests) and good.request_ids == ["a"]


def test_a_dead_engine_is_the_same_error_for_both_clients():
    """The offline `LLM`'s client reports a dead engine with the server client's class, so one
    `except EngineDeadError` (the 503 handler's) covers both."""
    import pytest

    from m3serve.engine.errors import EngineDeadError
    from m3serve.engine.sync_client import SyncEngineClient

    client = SyncEngineClient.__new__(SyncEngineClient)        # no processes: only its books
    client.dead_reason = "rank 1 (pid 7) exited with code -9"
    with pytest.raises(EngineDeadError, match=r"rank 1 \(pid 7\)"):
        client.settle()
