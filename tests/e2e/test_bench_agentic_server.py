"""`m3serve bench serve --dataset-name agentic | agentic-trace` against the tiny-model server.

The server's own /metrics counters (read here, independently of the bench) are the reference:
the bench's hit counts and re-prefilled tokens must equal their deltas, later turns must hit
the prefix cache on the conversation they re-send, and think times must be kept.
"""
import argparse
import itertools
import json

from m3serve.bench import serve
from m3serve.bench.agentic import SyntheticConfig, generate_sessions

BLOCK = 16          # the tiny model's KV block (= its sparse block size)


def _args(server, tiny_dir, *extra):
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(["--base-url", server.url, "--tokenizer", str(tiny_dir),
                              "--disable-tqdm", *extra])


def _delta(before, after, name):
    return after[f"m3serve:{name}"] - before[f"m3serve:{name}"]


def test_agentic_sessions_hit_the_prefix_cache_as_the_server_counts(server, tiny_dir):
    flags = ["--dataset-name", "agentic", "--agentic-sessions", "3", "--agentic-turns", "3",
             "--agentic-first-input-len", "200", "--agentic-new-tokens", "40",
             "--agentic-new-tokens-sigma", "0", "--agentic-output-len", "8",
             "--agentic-output-len-sigma", "0", "--agentic-think-time", "0.05",
             "--agentic-think-time-sigma", "0", "--max-concurrency", "2", "--seed", "5"]
    args = _args(server, tiny_dir, *flags)
    before = server.wait_idle()
    result = serve.main(args)
    after = server.wait_idle()

    assert (result["completed"], result["failed"], result["num_sessions_aborted"]) == (9, 0, 0)
    assert result["ignore_eos"] is True and result["total_output_tokens"] == 9 * 8
    # the bench's figures are the server's counter deltas
    hits = _delta(before, after, "prefix_cache_hits_total")
    assert result["prefix_cache_hits_gpu"] == hits > 0
    assert result["prefix_cache_queries_gpu"] == _delta(before, after, "prefix_cache_queries_total")
    sent = _delta(before, after, "prompt_tokens_total")
    assert result["prompt_tokens_sent"] == sent == result["prefix_cache_queries_gpu"]
    assert result["reprefilled_tokens"] == sent - hits
    assert result["prefix_cache_hit_rate_gpu"] == hits / sent
    # this server has no CPU tier: its counters exist (as vLLM's do) and stay at zero
    assert result["prefix_cache_hits_cpu"] == 0 and result["prefix_cache_queries_cpu"] == 0
    # what each request's usage says was cached adds up to the same hits (no memory pressure
    # here: one lookup per prompt token, no preemption)
    assert sum(result["cached_tokens"]) == hits
    assert result["usage_reprefilled_tokens"] == result["reprefilled_tokens"]
    assert result["num_preemptions"] == _delta(before, after, "num_preemptions_total") == 0
    assert result["prefix_cache_lookups_per_prompt_token"] == 1.0

    per_turn = {t["turn"]: t for t in result["per_turn"]}
    assert sorted(per_turn) == [0, 1, 2] and all(t["num_requests"] == 3 for t in per_turn.values())
    back = result["returning_turns"]                        # turns 1 and 2 pooled
    assert back["turn"] == "1+" and back["num_requests"] == 6
    assert min(per_turn[1]["median_ttft_ms"], per_turn[2]["median_ttft_ms"]) <= back["median_ttft_ms"] \
        <= max(per_turn[1]["p90_ttft_ms"], per_turn[2]["p90_ttft_ms"])
    assert per_turn[0]["mean_cached_tokens"] == 0          # every session starts on fresh text
    assert all(per_turn[k]["mean_cached_tokens"] > 0 for k in (1, 2))
    assert all(t["p90_ttft_ms"] > 0 for t in per_turn.values())
    assert result["p90_e2e_norm_intvty"] > 0

    # per session: every later turn re-sent the previous prompt (a prefix hit over all but the
    # blocks at the seam), and waited its think time after the previous reply
    plan = {s.session_id: s for s in generate_sessions(SyntheticConfig(
        num_sessions=3, num_turns=3, first_input_len=200, new_tokens_median=40,
        new_tokens_sigma=0, output_len_median=8, output_len_sigma=0, think_time_median_s=0.05,
        think_time_sigma=0), seed=5)}
    rows = sorted(zip(result["session_ids"], result["turn_indices"], result["input_lens"],
                      result["cached_tokens"], result["start_times"], result["latencies"]))
    for prev, cur in itertools.pairwise(rows):
        if prev[0] != cur[0]:
            continue
        session, turn, prompt_len, cached, start, _ = cur
        _, _, prev_len, _, prev_start, prev_e2el = prev
        assert prompt_len > prev_len + 8
        assert (prev_len // BLOCK - 2) * BLOCK <= cached < prompt_len
        assert start - (prev_start + prev_e2el) >= plan[session].turns[turn].think_time_s - 1e-3


def test_agentic_trace_replay_against_the_server(server, tiny_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"id": "t0", "block_size": 16, "requests": [
        {"type": "n", "in": 120, "out": 6, "think_time": 0.0},
        {"type": "n", "in": 170, "out": 6, "think_time": 0.02}]}) + "\n")
    before = server.wait_idle()
    result = serve.main(_args(server, tiny_dir, "--dataset-name", "agentic-trace",
                              "--dataset-path", str(trace)))
    after = server.wait_idle()
    assert (result["completed"], result["num_sessions"], result["dataset_path"]) == (2, 1, str(trace))
    assert result["prefix_cache_hits_gpu"] == _delta(before, after, "prefix_cache_hits_total") > 0
    assert result["per_turn"][1]["mean_cached_tokens"] > 0
