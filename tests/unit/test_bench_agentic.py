"""The agentic multi-turn workload: the generator's statistics, the conversation each turn
re-sends, trace replay (ours and InferenceX/Weka lines, bad files), the session loop over a
stand-in client, and the metric arithmetic (interactivity, counters, re-prefilled tokens)."""
import asyncio
import itertools
import json
import time

import numpy as np
import pytest

from m3serve.bench import agentic_serve
from m3serve.bench.agentic import (Conversation, SessionSpec, SyntheticConfig, TraceError, TurnSpec,
                                   generate_sessions, load_trace, turn_texts)
from m3serve.bench.agentic_serve import (TurnRecord, parse_prefix_cache_counters,
                                         prefix_cache_summary, run_sessions)
from m3serve.bench.metrics import RequestRecord, e2e_normalized_interactivity
from m3serve.bench.serve import Target, parse_spec_decode_counters
from letter_tokenizer import LetterTokenizer




# ---- the synthetic generator ---------------------------------------------------------------

def test_generator_is_deterministic_per_seed():
    config = SyntheticConfig(num_sessions=5, num_turns=6, min_turns=2)
    assert generate_sessions(config, seed=3) == generate_sessions(config, seed=3)
    assert generate_sessions(config, seed=3) != generate_sessions(config, seed=4)


def test_generator_statistics_follow_the_config():
    config = SyntheticConfig(num_sessions=600, num_turns=10, min_turns=4, first_input_len=8192,
                             new_tokens_median=500, new_tokens_sigma=1.4, output_len_median=300,
                             output_len_sigma=1.0, think_time_median_s=2.0, think_time_sigma=1.0,
                             max_think_time_s=10.0)
    sessions = generate_sessions(config, seed=0)
    assert len(sessions) == 600
    num_turns = [len(s.turns) for s in sessions]
    assert min(num_turns) == 4 and max(num_turns) == 10     # uniform over [4, 10]
    assert abs(np.mean(num_turns) - 7.0) < 0.3
    assert all(s.turns[0].new_tokens == 8192 and s.turns[0].think_time_s == 0 for s in sessions)
    later = [t for s in sessions for t in s.turns[1:]]
    new = np.array([t.new_tokens for t in later])
    out = np.array([t.output_len for s in sessions for t in s.turns])
    think = np.array([t.think_time_s for t in later])
    # lognormal: median = the configured median, std of the log = sigma
    assert np.median(new) == pytest.approx(500, rel=0.1)
    assert np.log(new).std() == pytest.approx(1.4, rel=0.1)
    assert np.median(out) == pytest.approx(300, rel=0.1)
    assert np.log(out).std() == pytest.approx(1.0, rel=0.1)
    assert np.median(think) == pytest.approx(2.0, rel=0.1)
    assert think.max() == 10.0 and (think == 10.0).mean() > 0.02     # the AgentX idle cap bites
    assert not any(t.reset or t.text for t in later)


def test_generator_rejects_bad_config():
    for bad in ({"num_sessions": 0}, {"num_turns": 0}, {"min_turns": 9, "num_turns": 8},
                {"new_tokens_median": 0}, {"think_time_sigma": -1.0},
                {"max_think_time_s": float("nan")}):
        with pytest.raises(ValueError, match="agentic"):
            generate_sessions(SyntheticConfig(**bad))


def test_turn_texts_have_the_planned_lengths_and_sessions_do_not_share_a_prefix():
    sessions = generate_sessions(SyntheticConfig(num_sessions=4, num_turns=3, first_input_len=50,
                                                 new_tokens_median=8, max_new_tokens=30), seed=1)
    texts = turn_texts(LetterTokenizer(), sessions, seed=1)
    for session, session_texts in zip(sessions, texts):
        assert [len(t) for t in session_texts] == [t.new_tokens for t in session.turns]
    assert len({t[0][:20] for t in texts}) == 4
    assert texts == turn_texts(LetterTokenizer(), sessions, seed=1)


# ---- the conversation ----------------------------------------------------------------------

@pytest.mark.parametrize("endpoint_type", ["completions", "chat"])
def test_each_turn_extends_the_previous_turn_and_its_reply(endpoint_type):
    conv = Conversation(endpoint_type)
    previous = None
    for k in range(4):
        conv.add_user(f"user{k} ")
        request = conv.request(7)
        assert request.expected_output_len == 7
        if previous is not None:
            prev_request, prev_reply = previous
            if endpoint_type == "chat":
                assert request.messages[:len(prev_request.messages)] == prev_request.messages
                assert request.messages[len(prev_request.messages)] == {
                    "role": "assistant", "content": prev_reply}
                assert request.messages[-1] == {"role": "user", "content": f"user{k} "}
            else:
                assert request.prompt == prev_request.prompt + prev_reply + f"user{k} "
        reply = f"reply{k} "
        conv.add_reply(reply)
        previous = (request, reply)
    conv.reset()
    conv.add_user("fresh")
    after = conv.request(1)
    assert (after.messages == [{"role": "user", "content": "fresh"}] if endpoint_type == "chat"
            else after.prompt == "fresh")


# ---- the session loop over a stand-in client ----------------------------------------------

def test_sessions_resend_actual_replies_honour_think_time_and_stop_on_failure(monkeypatch):
    sent = []      # (session first text, prompt, time sent)

    async def fake_send(target, request):
        now = time.perf_counter()
        sent.append((request.prompt.split("|")[0], request.prompt, now))
        await asyncio.sleep(0.01)
        if request.prompt.endswith("FAIL|"):
            return RequestRecord(prompt_len=len(request.prompt), start_time=now, error="HTTP 400: x")
        reply = f"<reply {len(sent)}>|"
        return RequestRecord(prompt_len=len(request.prompt), start_time=now,
                             chunk_times=[now + 0.005, now + 0.01], output_tokens=2, success=True,
                             generated_text=reply)

    monkeypatch.setattr(agentic_serve, "send_request", fake_send)
    sessions = [SessionSpec("a", (TurnSpec(1, 2), TurnSpec(1, 2, 0.15), TurnSpec(1, 2, 0.05))),
                SessionSpec("b", (TurnSpec(1, 2), TurnSpec(1, 2, 0.0), TurnSpec(1, 2, 0.0)))]
    texts = [["A|", "a1|", "a2|"], ["B|", "FAIL|", "never sent|"]]
    target = Target("http://x/v1/completions", "m")
    records, aborted = asyncio.run(run_sessions(target, sessions, texts, [0.0, 0.0], None))
    assert aborted == 1
    by_session = {}
    for first, prompt, t in sent:
        by_session.setdefault(first, []).append((prompt, t))
    prompts_b = [p for p, _ in by_session["B"]]         # the failed turn ends the session
    assert len(prompts_b) == 2 and prompts_b[1].startswith("B|<reply ") and prompts_b[1].endswith("FAIL|")
    prompts_a = [p for p, _ in by_session["A"]]
    assert len(prompts_a) == 3
    for prev, cur in itertools.pairwise(prompts_a):
        assert cur.startswith(prev + "<reply ")      # the whole conversation + the actual reply
    # think time runs from the previous reply's end (its send + 10 ms) to the next send
    times_a = [t for _, t in by_session["A"]]
    assert times_a[1] - times_a[0] >= 0.15 + 0.01
    assert times_a[2] - times_a[1] >= 0.05 + 0.01
    turns_a = sorted((r for r in records if r.session_id == "a"), key=lambda r: r.turn)
    assert [r.turn for r in turns_a] == [0, 1, 2]
    # the new context of a later turn = its prompt - previous prompt - previous reply (2 tokens)
    assert turns_a[1].new_context_tokens == (
        turns_a[1].record.prompt_len - turns_a[0].record.prompt_len - 2)
    assert turns_a[0].new_context_tokens == turns_a[0].record.prompt_len


def test_live_sessions_are_capped_across_think_times(monkeypatch):
    live, peak = set(), [0]

    async def fake_send(target, request):
        session = request.prompt[0]
        live.add(session)
        peak[0] = max(peak[0], len(live))
        await asyncio.sleep(0.005)
        now = time.perf_counter()
        if request.prompt.count("r") == 2:      # the session's last turn
            live.discard(session)
        return RequestRecord(prompt_len=1, start_time=now, chunk_times=[now], output_tokens=1,
                             success=True, generated_text="r")

    monkeypatch.setattr(agentic_serve, "send_request", fake_send)
    sessions = [SessionSpec(str(i), (TurnSpec(1, 1), TurnSpec(1, 1, 0.02), TurnSpec(1, 1, 0.02)))
                for i in range(6)]
    texts = [[f"{i}", "x", "y"] for i in range(6)]
    asyncio.run(run_sessions(Target("http://x/v1/completions", "m"), sessions, texts,
                             [0.0] * 6, max_concurrency=2))
    assert peak[0] == 2


# ---- traces --------------------------------------------------------------------------------

def _write(tmp_path, lines, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return path


def test_our_trace_format_replays_as_written(tmp_path):
    path = _write(tmp_path, [
        {"session_id": "s1", "turns": [
            {"new_tokens": 100, "output_tokens": 20},
            {"text": "the tool said hello", "output_tokens": 5, "think_time_s": 1.5},
            {"new_tokens": 40, "output_tokens": 3, "think_time_s": 99, "reset": True}]},
        "",
        {"turns": [{"new_tokens": 7, "output_tokens": 1}]},
    ])
    sessions = load_trace(path, max_think_time_s=10.0)
    assert sessions == [
        SessionSpec("s1", (TurnSpec(100, 20), TurnSpec(0, 5, 1.5, text="the tool said hello"),
                           TurnSpec(40, 3, 10.0, reset=True))),
        SessionSpec("session-1", (TurnSpec(7, 1),))]
    assert load_trace(path, max_sessions=1, max_turns=2) == [
        SessionSpec("s1", (TurnSpec(100, 20), TurnSpec(0, 5, 1.5, text="the tool said hello")))]
    texts = turn_texts(LetterTokenizer(), sessions)
    assert texts[0][1] == "the tool said hello" and len(texts[0][0]) == 100


def test_inferencex_weka_trace_becomes_sessions(tmp_path):
    # the shape of the AgentX corpus (block_size 64): a turn that extends the previous one, a
    # compaction (the prefix is not shared), and a subagent, which becomes a session of its own
    trace = {"id": "trace_a", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 8192, "out": 312, "hash_ids": list(range(1, 129)),
         "think_time": 0.0},
        {"t": 9.7, "type": "n", "in": 8704, "out": 540, "hash_ids": list(range(1, 137)),
         "think_time": 5.6},
        {"t": 22.4, "type": "subagent", "agent_id": "agent_007", "requests": [
            {"t": 22.4, "type": "n", "in": 5120, "out": 822, "hash_ids": list(range(7001, 7081)),
             "think_time": 0.0}]},
        {"t": 40.0, "type": "n", "in": 4000, "out": 100, "hash_ids": list(range(900, 963)),
         "think_time": 31.0},
        {"t": 45.0, "type": "n", "in": 4400, "out": 50, "think_time": 2.0},
    ]}
    sessions = load_trace(_write(tmp_path, [trace]))
    assert sessions == [
        SessionSpec("trace_a", (TurnSpec(8192, 312), TurnSpec(8704 - 8192 - 312, 540, 5.6),
                                TurnSpec(4000, 100, 10.0, reset=True),
                                TurnSpec(4400 - 4000 - 100, 50, 2.0))),
        SessionSpec("trace_a/agent_007", (TurnSpec(5120, 822),))]


@pytest.mark.parametrize("lines, message", [
    ([{"turns": [{"new_tokens": 5, "output_tokens": 1}]}, "{not json"], r"line 2: not valid JSON"),
    ([{"turns": [{"new_tokens": 5, "output_tokens": 1},
                 {"new_tokens": 5, "output_tokens": -3}]}], r"line 1: turn 1: output_tokens"),
    ([{"turns": [{"output_tokens": 1}]}], r"line 1: turn 0: needs new_tokens or text"),
    ([{"turns": [{"new_tokens": 1, "output_tokens": 1, "colour": 1}]}], r"line 1: .*colour"),
    ([{"turns": []}], r"line 1: 'turns' must be a non-empty list"),
    (["", {"turns": [{"new_tokens": 1, "output_tokens": 1, "think_time_s": -1}]}],
     r"line 2: turn 0: think_time_s"),
    (["[1, 2]"], r"line 1: must be a JSON object"),
    ([{"session": 1}], r"line 1: needs 'turns'"),
    ([{"id": "t", "requests": [{"in": 10, "out": 0}]}], r"line 1: request 0: out"),
    ([{"id": "t", "requests": [{"type": "subagent", "requests": []}]}],
     r"line 1: request 0 \(subagent\)"),
    ([""], r"no sessions"),
])
def test_bad_trace_files_name_the_line(tmp_path, lines, message):
    with pytest.raises(TraceError, match=message):
        load_trace(_write(tmp_path, lines))


def test_missing_trace_file_names_the_path(tmp_path):
    with pytest.raises(TraceError, match="no-such.jsonl"):
        load_trace(tmp_path / "no-such.jsonl")


# ---- metrics -------------------------------------------------------------------------------

def test_e2e_normalized_interactivity_inverts_the_percentile_of_seconds_per_token():
    records = [
        RequestRecord(prompt_len=1, start_time=0.0, chunk_times=[0.5, 1.0], output_tokens=10,
                      success=True),                                     # 0.1 s/token
        RequestRecord(prompt_len=1, start_time=1.0, chunk_times=[2.0, 3.0], output_tokens=10,
                      success=True),                                     # 0.2 s/token
        RequestRecord(prompt_len=1, start_time=0.0, chunk_times=[0.5], output_tokens=1,
                      success=True),                                     # 0.5 s/token
        RequestRecord(prompt_len=1, start_time=0.0, error="boom"),
    ]
    r = e2e_normalized_interactivity(records, [90.0])
    # P90 of [0.1, 0.2, 0.5] (linear) = 0.2 + 0.8 * 0.3 = 0.44 s/token -> 1 / 0.44 tok/s
    assert r["p90_e2e_norm_intvty"] == pytest.approx(1 / 0.44)
    assert r["median_e2e_norm_intvty"] == pytest.approx(5.0)
    assert r["mean_e2e_norm_intvty"] == pytest.approx(1 / (0.8 / 3))
    assert e2e_normalized_interactivity(records[3:], [90.0])["p90_e2e_norm_intvty"] is None


_BOTH_FAMILIES = """\
# HELP m3serve:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE m3serve:prefix_cache_queries_total counter
m3serve:prefix_cache_queries_total{model_name="m",engine="0"} 1000.0
m3serve:prefix_cache_queries_total{model_name="m",engine="1"} 500.0
m3serve:prefix_cache_hits_total{model_name="m"} 600.0
m3serve:prefix_cache_hit_rate{model_name="m"} 0.4
m3serve:external_prefix_cache_queries_total{model_name="m"} 900.0
m3serve:external_prefix_cache_hits_total{model_name="m"} 300.0
m3serve:num_preemptions_total{model_name="m"} 4.0
m3serve:spec_decode_num_drafts_total{model_name="m"} 10.0
m3serve:spec_decode_num_draft_tokens_total{model_name="m"} 30.0
m3serve:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0
m3serve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 8.0
vllm:prefix_cache_queries_total{model_name="m",engine="0"} 1000.0
vllm:prefix_cache_queries_total{model_name="m",engine="1"} 500.0
vllm:prefix_cache_hits_total{model_name="m"} 600.0
vllm:external_prefix_cache_queries_total{model_name="m"} 900.0
vllm:external_prefix_cache_hits_total{model_name="m"} 300.0
vllm:spec_decode_num_drafts_total{model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 8.0
"""


def test_counters_are_read_once_though_m3serve_exposes_both_name_families():
    assert parse_prefix_cache_counters(_BOTH_FAMILIES) == {
        "gpu_queries": 1500.0, "gpu_hits": 600.0, "cpu_queries": 900.0, "cpu_hits": 300.0,
        "preemptions": 4.0}
    spec = parse_spec_decode_counters(_BOTH_FAMILIES)
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (10, 30, 12)
    assert spec["per_pos"] == {0: 8.0}


def test_vllm_names_and_a_server_without_cpu_tier_or_counters():
    vllm_only = "\n".join(line for line in _BOTH_FAMILIES.splitlines()
                          if line.startswith("vllm:") and "external" not in line)
    assert parse_prefix_cache_counters(vllm_only) == {"gpu_queries": 1500.0, "gpu_hits": 600.0}
    assert parse_prefix_cache_counters("# nothing\nother_metric 1.0\n") is None


def _turn(turn, prompt, out, new, cached=None, ok=True):
    rec = RequestRecord(prompt_len=prompt, start_time=0.0, output_tokens=out, success=ok,
                        cached_tokens=cached)
    return TurnRecord("s", turn, rec, new_context_tokens=new)


def test_prefix_cache_summary_per_tier_and_reprefilled_tokens():
    turns = [_turn(0, 1000, 50, 1000, 0), _turn(1, 1300, 50, 250, 1024),
             _turn(2, 1600, 50, 250, 1536), _turn(3, 2000, 0, 0, ok=False)]
    before = {"gpu_queries": 100.0, "gpu_hits": 10.0, "cpu_queries": 5.0, "cpu_hits": 1.0}
    after = {"gpu_queries": 4000.0, "gpu_hits": 2058.0, "cpu_queries": 405.0, "cpu_hits": 257.0}
    s = prefix_cache_summary(turns, before, after)
    assert s["prompt_tokens_sent"] == 3900
    assert (s["prefix_cache_queries_gpu"], s["prefix_cache_hits_gpu"]) == (3900, 2048)
    assert s["prefix_cache_hit_rate_gpu"] == pytest.approx(2048 / 3900)
    assert (s["prefix_cache_queries_cpu"], s["prefix_cache_hits_cpu"]) == (400, 256)
    assert s["prefix_cache_hit_rate_cpu"] == pytest.approx(256 / 400)
    assert s["reprefilled_tokens"] == 3900 - 2048 - 256
    assert s["ideal_prefill_tokens"] == 1500
    assert s["excess_reprefilled_tokens"] == 3900 - 2048 - 256 - 1500
    assert s["usage_cached_tokens"] == 2560 and s["usage_reprefilled_tokens"] == 3900 - 2560
    assert s["prefix_cache_lookups_per_prompt_token"] == 1.0 and s["num_preemptions"] is None
    retried = prefix_cache_summary(turns, {"gpu_queries": 0.0, "gpu_hits": 0.0, "preemptions": 2.0},
                                   {"gpu_queries": 7800.0, "gpu_hits": 2048.0, "preemptions": 5.0})
    assert retried["prefix_cache_lookups_per_prompt_token"] == 2.0 and retried["num_preemptions"] == 3
    no_cpu = prefix_cache_summary(turns, {"gpu_queries": 0.0, "gpu_hits": 0.0},
                                  {"gpu_queries": 3900.0, "gpu_hits": 2048.0})
    assert no_cpu["prefix_cache_hit_rate_cpu"] is None and no_cpu["reprefilled_tokens"] == 1852
    assert prefix_cache_summary(turns, None, None)["reprefilled_tokens"] is None


def test_cli_rejects_inconsistent_dataset_flags():
    from m3serve.bench.serve import check_dataset_args
    from m3serve.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "serve", "--dataset-name", "agentic-trace"])
    with pytest.raises(ValueError, match="--dataset-path"):
        check_dataset_args(args)
    args = parser.parse_args(["bench", "serve", "--dataset-path", "x.jsonl"])
    with pytest.raises(ValueError, match="agentic-trace"):
        check_dataset_args(args)
    args = parser.parse_args(["bench", "serve", "--dataset-name", "agentic"])
    check_dataset_args(args)
    assert args.ignore_eos is True          # AgentX locks ignore_eos on
    args = parser.parse_args(["bench", "serve"])
    check_dataset_args(args)
    assert args.ignore_eos is False         # vllm bench serve's default is kept
