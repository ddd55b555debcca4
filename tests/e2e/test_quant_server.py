"""A quantised checkpoint through the server: `m3serve serve DIR` of a Quark MXFP4 fixture
answers a completion with the tokens the offline `LLM` gives for it; a flag that contradicts the
checkpoint (online quantisation of an already quantised one) stops start-up in one line."""
import httpx

from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams
from serverutil import MODEL_NAME, LiveServer, free_port
from test_startup_errors import serve

PROMPT_IDS = [5, 17, 300, 1021, 77, 1999, 64, 8, 150, 913, 12, 40]


def test_quantised_checkpoint_serves_its_offline_tokens(quant_dir, tmp_path):
    path = quant_dir("mxfp4-quark")
    srv = LiveServer(path, "--max-num-seqs", "4", log_path=tmp_path / "server.log")
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    finally:
        srv.stop()
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["text"]
    offline = LLM(model=str(path)).generate([{"prompt_token_ids": PROMPT_IDS}],
                                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                            use_tqdm=False)[0].outputs[0]
    assert len(offline.token_ids) == 8 and served == offline.text
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_online_quantisation_of_a_quantised_checkpoint_is_refused(quant_dir):
    done, _ = serve("serve", str(quant_dir("mxfp8")), "--host", "127.0.0.1", "--port", str(free_port()),
                    "--quantization", "mxfp4")
    out = done.stdout + done.stderr
    assert done.returncode == 2
    assert "quantization='mxfp4' quantises a BF16 checkpoint online" in out and "already quantised (MXFP8)" in out
    assert "Traceback" not in out
