"""Runs the real Claude Code and Codex CLIs against `m3serve serve` on the tiny model, for
tests/e2e/test_agent_clients.py. Started by that test inside a network namespace that has only
loopback (`unshare --net`), so neither the server nor the clients can reach anything else.

The model's weights are random, so the server steers token choice (M3SERVE_TEST_STEER,
m3serve/serving/steer.py): each client's first turn is constrained to thinking plus a call of
one of its own tools that reads a note in the work folder; its second turn only matches once the
prompt holds both the note's contents (the tool's result) and the first turn's thinking as the
chat template renders it, and is constrained to a final answer. Everything else (the engine, the
grammar mask, the detokenizer, the reasoning and tool-call parsers, the API dialects) runs for real.

Usage: python agent_run.py CONFIG.json, where CONFIG names the model folder, the installed CLIs
(`npm install --prefix DIR ...`), a work folder and the clients to run; the result is written as
JSON next to it (each client's exit code, output, seconds; the server log's path).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PORT = 8000                 # the namespace is empty: any port is free
MODEL_NAME = "minimax-m3-tiny"
SECRET = "STEERMARKER42"    # only in the note: a prompt holding it holds the tool's result
ANSWER = "ANSWER-OK"        # only in the second turn's steered output
NS = "]<]minimax[>["

# What each client is asked, its tool call reading the note, and the thinking before it.
CLIENTS = {
    "claude": {"ask": "Claude, read the file note.txt and tell me the secret word.",
               "thought": "I should read note.txt with the Read tool.",
               "call": ("Read", "file_path", "{work}/note.txt")},
    "codex": {"ask": "Codex, show me what note.txt says.",
              "thought": "I will print note.txt with a shell command.",
              "call": ("exec_command", "cmd", "cat note.txt")},
}


def steering_rules(work: Path) -> list[dict]:
    rules = []
    for client in CLIENTS.values():
        tool, argument, value = client["call"]
        call = (f"{NS}<tool_call>\n{NS}<invoke name=\"{tool}\">\n{NS}<{argument}>{value.format(work=work)}"
                f"{NS}</{argument}>\n{NS}</invoke>\n{NS}</tool_call>")
        # the second turn: the tool's result and the first turn's thinking, rendered back
        rules.append({"when": [SECRET, f"<mm:think>\n{client['thought']}\n</mm:think>"],
                      "output": f"<mm:think>\nThe note holds the word.\n</mm:think>\n{ANSWER}: the word is {SECRET}."})
        rules.append({"when": [client["ask"]], "output": f"<mm:think>\n{client['thought']}\n</mm:think>\n{call}"})
    rules.append({"when": [], "output": "OK."})     # anything else the clients ask on the side
    return rules


def _wait_ready(proc: subprocess.Popen, deadline_s: float) -> None:
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("the server did not become ready")


def _quiet_env(home: Path) -> dict:
    """The clients' environment: their own home, no telemetry, updates or other side traffic."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    return {**env, "HOME": str(home), "NO_COLOR": "1", "CI": "1",
            # Claude Code
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1",
            # Codex
            "CODEX_HOME": str(home / ".codex"), "RUST_LOG": "error"}


def run_claude(clis: Path, work: Path, home: Path, timeout_s: float) -> dict:
    env = {**_quiet_env(home), "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{PORT}", "ANTHROPIC_API_KEY": "dummy",
           "ANTHROPIC_MODEL": MODEL_NAME, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL_NAME,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL_NAME, "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL_NAME}
    cli = clis / "node_modules" / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
    cmd = ["node", str(cli), "-p", CLIENTS["claude"]["ask"], "--allowedTools", "Read"]
    return _run(cmd, work, env, timeout_s)


def run_codex(clis: Path, work: Path, home: Path, timeout_s: float) -> dict:
    env = _quiet_env(home)
    codex_home = Path(env["CODEX_HOME"])
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL_NAME}"\nmodel_provider = "m3serve"\ncheck_for_update_on_startup = false\n\n'
        f'[analytics]\nenabled = false\n\n'
        f'[model_providers.m3serve]\nname = "m3serve"\nbase_url = "http://127.0.0.1:{PORT}/v1"\n'
        f'wire_api = "responses"\n')
    last = work / "codex-last-message.txt"
    cli = clis / "node_modules" / "@openai" / "codex" / "bin" / "codex.js"
    cmd = ["node", str(cli), "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access",
           "--output-last-message", str(last), CLIENTS["codex"]["ask"]]
    result = _run(cmd, work, env, timeout_s)
    result["last_message"] = last.read_text() if last.exists() else ""
    return result


def _run(cmd: list[str], work: Path, env: dict, timeout_s: float) -> dict:
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=timeout_s)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", e.stdout or "", e.stderr or ""
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x for x in (out, err))
    return {"rc": rc, "stdout": out[-20000:], "stderr": err[-20000:], "seconds": round(time.time() - start, 1)}


RUNNERS = {"claude": run_claude, "codex": run_codex}


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    work, clis, model = Path(config["work"]), Path(config["clis"]), config["model"]
    (work / "note.txt").write_text(f"The secret word is {SECRET}.\n")
    steer = work.parent / "steer.json"
    steer.write_text(json.dumps({"rules": steering_rules(work)}))
    log_path = work.parent / "server.log"
    env = {**os.environ, "M3SERVE_TEST_STEER": str(steer)}
    result: dict = {"server_log": str(log_path), "clients": {}}
    with open(log_path, "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "m3serve", "serve", model, "--host", "127.0.0.1",
                                   "--port", str(PORT), "--served-model-name", MODEL_NAME,
                                   "--reasoning-parser", "minimax_m3", "--tool-call-parser", "minimax_m3",
                                   "--enable-auto-tool-choice", "--uvicorn-log-level", "info",
                                   *config.get("server_flags", [])],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(server, 240)
            for name in config["clients"]:
                home = work.parent / f"home-{name}"
                home.mkdir(exist_ok=True)
                result["clients"][name] = RUNNERS[name](clis, work, home, config.get("timeout_s", 240))
        except Exception as e:
            result["error"] = repr(e)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    Path(config["result"]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
