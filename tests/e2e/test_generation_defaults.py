"""The server's request defaults come from the model's generation_config.json, with
--override-generation-config over them; a request's own values win."""
import json
import shutil

import httpx
from serverutil import MODEL_NAME, LiveServer


def test_generation_config_defaults_through_the_server(tiny_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=1.0, top_k=1, max_new_tokens=9)      # top_k 1: sampling is greedy
    (model / "generation_config.json").write_text(json.dumps(config))
    server = LiveServer(model, "--override-generation-config", '{"max_new_tokens": 5}',
                        "--uvicorn-log-level", "info", log_path=tmp_path / "server.log")
    try:
        log = server.log_path.read_text()
        assert "request sampling defaults from the generation config" in log
        assert "engine configuration:" in log and "memory plan:" in log and "KV blocks of 16 tokens" in log
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "tell me more"}], "ignore_eos": True}
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5   # override over file

        def text(**fields):
            body = {"model": MODEL_NAME, "prompt": "the river and the stone", "max_tokens": 12,
                    "ignore_eos": True, **fields}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        greedy = text(temperature=0)
        assert all(text(seed=s) == greedy for s in range(3))           # the file's top_k 1 applies
        sampled = {text(seed=s, top_k=0) for s in range(4)}            # the request's top_k wins
        assert sampled != {greedy}
    finally:
        server.stop()
