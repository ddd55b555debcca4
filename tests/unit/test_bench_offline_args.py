"""`bench offline`: its sampling flags reach the SamplingParams of its runs; its speculation
figures."""
import argparse

from m3serve.bench.offline import add_cli_args, run_params


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(["--model", "m", *argv])


def test_default_runs_are_greedy():
    p = run_params(_args(), 65)
    assert p.is_greedy and p.max_tokens == 65 and p.ignore_eos and p.top_p == 1.0


def test_temperature_and_top_p_are_used():
    p = run_params(_args("--temperature", "0.7", "--top-p", "0.9"), 1)
    assert not p.is_greedy and p.temperature == 0.7 and p.top_p == 0.9 and p.max_tokens == 1


def test_speculation_figures_of_the_measured_runs():
    """A point's speculation figures count only its measured runs: verify and plain steps, the
    steps by the drafts each request verified, and, under the measured gate, where each bucket
    stands (JSON-ready)."""
    import json
    from types import SimpleNamespace

    from m3serve.bench.offline import _spec_counts, _spec_figures
    from m3serve.core.scheduler import SpecDecodeStats
    from m3serve.core.spec_gate import SpeculationGate, _Bucket

    gate = SpeculationGate(7, measured=True)
    sched = SimpleNamespace(spec_stats=SpecDecodeStats(7), num_plain_steps=2, num_deferred_steps=2,
                            num_landing_steps=0, num_steps_by_width={7: 3}, spec_gate=gate)
    llm = SimpleNamespace(engine=SimpleNamespace(core=SimpleNamespace(scheduler=sched),
                                                 config=SimpleNamespace(speculative=SimpleNamespace(enabled=True))))
    before = _spec_counts(llm)
    for kept in (1, 2, 0):
        sched.spec_stats.record(3, kept)
    sched.num_plain_steps += 5
    sched.num_steps_by_width = {7: 4, 3: 2, 0: 1}
    gate.buckets[4] = _Bucket(gate.widths)
    gate.buckets[4].choice = 0
    figures = _spec_figures(llm, before)
    assert figures["spec_verify_steps"] == 3 and figures["spec_plain_steps"] == 5
    assert figures["mean_acceptance_length"] == 2.0
    assert figures["spec_steps_by_width"] == {"0": 1, "3": 2, "7": 1}
    assert figures["spec_gate"] == "measured" and figures["spec_gate_state"]["buckets"][4]["choice"] == 0
    json.dumps(figures)


def test_step_times_by_running_requests_and_arm():
    """Each engine step's wall time lands under its running requests and the arm the scheduler
    counted for it (plain, a landing step, a width of drafts; mixed when one call ran several)."""
    from m3serve.bench.offline import _add_step_time, _step_time_summary

    times = {}
    _add_step_time(times, 4, (0, 0, {}), (0, 0, {3: 1}), 0.0146)
    _add_step_time(times, 4, (0, 0, {3: 1}), (0, 0, {3: 2}), 0.0150)
    _add_step_time(times, 2, (0, 0, {3: 2}), (1, 0, {3: 2}), 0.007)
    _add_step_time(times, 2, (1, 0, {3: 2}), (1, 1, {3: 2, 0: 1}), 0.02)
    _add_step_time(times, 1, (1, 1, {}), (1, 1, {}), 0.001)
    assert _step_time_summary(times) == {"4/w3": [2, 29.6], "2/mixed": [1, 20.0], "2/plain": [1, 7.0],
                                         "1/idle": [1, 1.0]}
