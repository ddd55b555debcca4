"""Start-up that tells the truth, fast: a busy port before the model loads, a checkpoint of
another architecture named as such, `--version`; one line, exit status 2, no traceback."""
import json
import socket
import subprocess
import sys
import time

from serverutil import REPO_ROOT, free_port


def serve(*args, timeout=120):
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "m3serve", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)
    return done, time.time() - t0


def test_busy_port_is_reported_before_the_model_loads(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # a model directory that does not exist: the port is checked first, so that error wins
        done, _ = serve("serve", str(tmp_path / "no-model-here"), "--host", "127.0.0.1", "--port", str(port))
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr


def test_another_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    done, _ = serve("serve", str(tmp_path), "--host", "127.0.0.1", "--port", str(free_port()))
    assert done.returncode == 2
    assert "model_type 'llama' (LlamaForCausalLM) is not MiniMax-M3" in done.stderr
    assert "Traceback" not in done.stderr


def test_version():
    done, _ = serve("--version")
    assert done.returncode == 0 and done.stdout.strip().startswith("m3serve ")


def test_an_engine_start_up_failure_is_one_line_and_exits(tiny_dir, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    (bad / "model.safetensors").write_bytes((tiny_dir / "model.safetensors").read_bytes()[:1000])
    done, _ = serve("serve", str(bad), "--host", "127.0.0.1", "--port", str(free_port()))
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-2000:]
    assert "m3serve: error: the engine failed to start" in done.stderr and "corrupt safetensors file" in done.stderr
    assert "Traceback" not in out
    debug, _ = serve("serve", str(bad), "--host", "127.0.0.1", "--port", str(free_port()), "--log-level", "debug")
    assert debug.returncode == 2 and "Traceback" in debug.stdout + debug.stderr     # details when asked
