"""`python -m m3serve.bench.step_profile --prefill` on the tiny model (CPU): it profiles the
batch's first step, which computes every waiting prompt token, and stops there."""
import json
import sys

import pytest


def test_prefill_profiles_the_first_step_and_stops(tiny_dir, monkeypatch, capsys):
    from m3serve.bench import step_profile
    monkeypatch.setattr(sys, "argv", ["step_profile", str(tiny_dir), "--batch", "2", "--isl", "40",
                                      "--prefill"])
    step_profile.main()
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    assert [r.get("waiting_prompt_tokens") for r in records] == [80]   # both prompts, one step
    assert records[0]["prefill_step_ms"] > 0
    assert not any("batch" in r for r in records)        # the decode profile did not run


def test_sync_debug_needs_mixed(tiny_dir, monkeypatch):
    from m3serve.bench import step_profile
    monkeypatch.setattr(sys, "argv", ["step_profile", str(tiny_dir), "--sync-debug"])
    with pytest.raises(SystemExit):
        step_profile.main()
