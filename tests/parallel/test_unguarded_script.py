"""`LLM(tensor_parallel_size=2)` from a script with no `if __name__ == "__main__":` guard, run as a
file and from standard input (`python -`): spawned engine processes must not re-run the user's
script, so both generate (they failed with "engine replica 0 ... exited with code 1")."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
from m3serve.llm import LLM
from m3serve.sampling_params import SamplingParams
print("script body ran", flush=True)
llm = LLM({model!r}, tensor_parallel_size=2, max_model_len=256, kv_cache_memory=1 << 20)
out = llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
print("TOKENS", len(out[0].outputs[0].token_ids), flush=True)
llm.shutdown()
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_unguarded_script_runs_tp2(tiny_dir, tmp_path, how):
    script = SCRIPT.format(model=str(tiny_dir))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    if how == "file":
        path = tmp_path / "unguarded.py"
        path.write_text(script)
        run = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=180)
    else:
        run = subprocess.run([sys.executable, "-"], input=script, cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TOKENS 3" in run.stdout
    assert run.stdout.count("script body ran") == 1        # not re-run by the engine processes
