"""Start `m3serve serve` on the embedded tiny model (or MODEL), then stream a chat answer through
the official `openai` client and print it as it arrives; the server is stopped at the end.

    python examples/chat_client.py                      # the tiny model (trained, a toy): docs-like text
    python examples/chat_client.py --port 8000          # the server it starts listens on port 8000
    python examples/chat_client.py --base-url http://127.0.0.1:8000/v1   # an already running server
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

REPO_ROOT = Path(__file__).resolve().parents[1]


def start_server(model: str | None, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "m3serve", "serve", *([model] if model else []), "--host", "127.0.0.1",
           "--port", str(port), "--reasoning-parser", "minimax_m3", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise SystemExit("the server was not ready in time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="checkpoint (default: the tiny model)")
    parser.add_argument("--port", type=int, default=None,
                        help="port of the server this starts on 127.0.0.1 (default: a free one)")
    parser.add_argument("--base-url", default=None, help="use this running server instead of starting one")
    parser.add_argument("--message", default="Tell me about the MiniMax-M3 model.")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    proc = None
    base_url = args.base_url
    if base_url is not None and (args.port is not None or args.model is not None):
        parser.error("--base-url names a running server: MODEL and --port are for the one this starts")
    if base_url is None:
        port = args.port
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        proc = start_server(args.model, port)
        base_url = f"http://127.0.0.1:{port}/v1"
    try:
        client = openai.OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
        model = client.models.list().data[0].id
        print(f"model: {model}\nuser: {args.message}\nassistant: ", end="", flush=True)
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": args.message}], max_tokens=args.max_tokens,
            stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            for choice in chunk.choices:
                reasoning = (choice.delta.model_extra or {}).get("reasoning_content")
                print((reasoning or "") + (choice.delta.content or ""), end="", flush=True)
            if chunk.usage is not None:
                print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} "
                      f"completion tokens]")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
