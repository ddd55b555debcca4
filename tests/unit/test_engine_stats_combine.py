"""The stats of DP replicas combined into the engine's: counts summed, histograms by bucket,
KV usage over the summed pools."""
from m3serve.core.engine_group import ReplicaBook
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
