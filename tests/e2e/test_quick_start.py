"""The README's quick start: `python examples/chat_client.py` starts `m3serve serve` on the
embedded tiny model, on the port it is given, and streams one chat answer through the official
`openai` client: text in the trained domain (its words are the docs' words; the random
`make-tiny` model's greedy answer to the same question has fewer than half of its words there)."""
import re
import subprocess
import sys

from serverutil import REPO_ROOT, free_port


def test_chat_client_serves_on_the_port_it_is_given_and_streams_an_answer():
    port = free_port()
    run = subprocess.run([sys.executable, "examples/chat_client.py", "--port", str(port), "--max-tokens", "32"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert f"listening on http://127.0.0.1:{port};" in out, out[-3000:]
    assert "model: minimax-m3-tiny" in run.stdout
    usage = re.search(r"\[\d+ prompt \+ (\d+) completion tokens\]", run.stdout)
    assert usage and 1 <= int(usage.group(1)) <= 32, run.stdout
    answer = run.stdout[run.stdout.index("assistant: ") + len("assistant: "):usage.start()]
    docs = set(re.findall(r"[A-Za-z]{3,}", (REPO_ROOT / "m3serve" / "model" / "tiny_corpus.md").read_text()))
    words = re.findall(r"[A-Za-z]{3,}", answer)
    assert len(words) >= 5 and sum(w in docs for w in words) >= 0.8 * len(words), answer


def test_chat_client_refuses_a_port_for_a_running_server():
    run = subprocess.run([sys.executable, "examples/chat_client.py", "--port", "8000", "--base-url",
                          "http://127.0.0.1:1/v1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--base-url names a running server" in run.stderr
