"""The real Claude Code and Codex CLIs against `m3serve serve` on the tiny model: each completes a
two-turn tool loop (a call of one of its own tools that reads a note, then an answer from the
tool's result), exits 0, and every request it sent was answered 2xx.

The clients and the server run inside a network namespace with only loopback (agent_run.py), so
nothing leaves the machine; the model's random weights are steered to the call and the answer by
M3SERVE_TEST_STEER, and the answer's rule only matches a second-turn prompt that holds both the
tool's result and the first turn's thinking.

Needs node, root (for `unshare --net`) and the CLIs installed with
`npm install --prefix DIR @anthropic-ai/claude-code@VERSION @openai/codex@VERSION` (the versions
.ci/run pins), DIR given as M3SERVE_AGENT_CLIS. Without them the tests skip, saying what is
missing; with M3SERVE_REQUIRE_AGENT_CLIS=1 (set by .ci/run) they fail instead.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from serverutil import REPO_ROOT

sys.path.insert(0, str(Path(__file__).parent))
import agent_run  # noqa: E402

CLIS = os.environ.get("M3SERVE_AGENT_CLIS")
REQUIRED = os.environ.get("M3SERVE_REQUIRE_AGENT_CLIS") == "1"
ACCESS_LINE = re.compile(r'"(GET|POST|HEAD|PUT|DELETE|OPTIONS) (\S+) HTTP/[\d.]+" (\d{3})')


def _missing() -> str | None:
    if not CLIS:
        return "M3SERVE_AGENT_CLIS is not set (the folder where .ci/run installs the agent CLIs with npm)"
    for package in ("@anthropic-ai/claude-code", "@openai/codex"):
        if not (Path(CLIS) / "node_modules" / package / "package.json").exists():
            return f"{package} is not installed under {CLIS}"
    for tool in ("node", "unshare", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    if os.geteuid() != 0:
        return "unshare --net needs root"
    return None


@pytest.fixture(scope="module")
def agent_runs(tiny_dir, tmp_path_factory):
    """Both clients, one after the other, against one server in one namespace."""
    missing = _missing()
    if missing:
        if REQUIRED:
            pytest.fail(f"the agent-client tests must run here (M3SERVE_REQUIRE_AGENT_CLIS=1): {missing}")
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("agents")
    work = root / "work"
    work.mkdir()
    config = {"model": str(tiny_dir), "clis": CLIS, "work": str(work), "clients": ["claude", "codex"],
              "result": str(root / "result.json"), "timeout_s": 200}
    (root / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    script = f"ip link set lo up && exec {sys.executable} {Path(agent_run.__file__)} {root / 'config.json'}"
    proc = subprocess.run(["unshare", "--net", "--", "sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and (root / "result.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((root / "result.json").read_text())
    log = Path(result["server_log"]).read_text(errors="replace")
    assert "error" not in result, result["error"] + "\n" + log[-5000:]
    return result, log


def _report(result: dict, log: str, name: str) -> str:
    run = result["clients"][name]
    return (f"{name}: rc {run['rc']} after {run['seconds']} s\nstdout: {run['stdout'][-2000:]}\n"
            f"stderr: {run['stderr'][-2000:]}\nserver log: {log[-4000:]}")


def _steered(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"steering: rule (\d+) applies", log)]


def test_server_answered_every_client_request_without_an_error(agent_runs):
    result, log = agent_runs
    statuses = [(m.group(1), m.group(2), int(m.group(3))) for m in ACCESS_LINE.finditer(log)]
    assert statuses, log[-3000:]
    bad = [s for s in statuses if s[2] >= 400]
    assert not bad, f"requests answered with errors: {bad}\n{log[-4000:]}"
    assert "Traceback" not in log


@pytest.mark.parametrize("name", ["claude", "codex"])
def test_client_completes_a_two_turn_tool_loop(agent_runs, name):
    result, log = agent_runs
    run = result["clients"][name]
    assert run["rc"] == 0, _report(result, log, name)
    answer = run.get("last_message") or run["stdout"]
    assert f"{agent_run.ANSWER}: the word is {agent_run.SECRET}" in answer, _report(result, log, name)
    # both of this client's rules were used: the call (first turn) and the answer, whose rule
    # matched only a prompt holding the tool's result and the first turn's thinking
    order = list(agent_run.CLIENTS)
    answer_rule, call_rule = 2 * order.index(name), 2 * order.index(name) + 1
    steered = _steered(log)
    assert call_rule in steered and answer_rule in steered, (steered, _report(result, log, name))
    assert steered.index(call_rule) < steered.index(answer_rule)
