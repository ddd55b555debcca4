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
    # with the vLLM flags a MiniMax-M3 recipe passes: accepted, applied or logged as not applicable
    recipe = ["--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests", "--language-model-only",
              "--attention-backend", "FLASH_ATTN", "--moe-backend", "triton", "--linear-backend", "cutlass",
              "--max-num-partial-prefills", "4", "--stream-interval", "3",
              "--compilation-config", '{"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4], '
                                      '"pass_config": {"fuse_allreduce_rms": true}}',
              "--hf-overrides", '{"text_config": {"max_position_embeddings": 2048}}']
    server = LiveServer(model, "--override-generation-config", '{"max_new_tokens": 5}', *recipe,
                        "--uvicorn-log-level", "info", log_path=tmp_path / "server.log")
    try:
        log = server.log_path.read_text()
        assert "request sampling defaults from the generation config" in log
        assert "engine configuration:" in log and "memory plan:" in log and "KV blocks of 16 tokens" in log
        assert "async scheduling on" in log
        for flag in ("--trust-remote-code", "--attention-backend FLASH_ATTN"):
            assert f"accepted, not applicable: {flag}" in log, flag
        assert "--compilation-config keys not applicable here, ignored: {'pass_config'" in log
        models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
        assert models["max_model_len"] == 2048            # --hf-overrides really changed the config
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                "model": MODEL_NAME, "prompt": "count", "max_tokens": 9, "ignore_eos": True, "stream": True,
                "temperature": 0}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert len([c for c in chunks if c["choices"]]) == 3          # --stream-interval 3: 9 tokens, 3 chunks
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
