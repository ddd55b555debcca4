"""`bench offline`'s sampling flags reach the SamplingParams of its runs."""
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
