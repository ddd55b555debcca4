"""The embedded tiny model stays put: `make_tiny` with one seed writes the same bytes on every
machine and at every commit (its tokenizer is stored, not trained on the package's code)."""
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import m3serve
from m3serve.model.files import tiny_model_cache_dir
from m3serve.model.tiny import make_tiny

# sha256 of make_tiny(dir, seed=0). Change them only on purpose: a new value is a new default model.
PINNED = {
    "chat_template.jinja": "57462af8001049cbda3dd9f8bc0cda648465304d7d104865fbdb51ec1a026407",
    "config.json": "1242e34bf67cee16a6f6ba6ae47517f8a9d55831a2822f26c8ef471e924bb833",
    "generation_config.json": "5aba2b1670757fe92c8875bf2ba18e681feec405dcf77226f7f9c086075489b2",
    "model.safetensors": "ac48e1d1b6f1cb04d97f8ed189924ec52fa25a41cf7b423b226447764e2f3208",
    "tokenizer.json": "bf0aef49926c0c27267b63a9f4e4df3518d22119dc1fa0ff54c2edf7ea4cf6ed",
    "tokenizer_config.json": "d9c8cb9cfbef1e8e2cdcb59618883df76b8327b4a65c8e46392335b5040d5333",
}


def digests(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


def test_make_tiny_writes_the_pinned_bytes(tmp_path):
    assert digests(make_tiny(tmp_path / "tiny", seed=0)) == PINNED


def test_new_code_in_the_package_changes_neither_the_model_nor_its_cache_folder(tmp_path):
    package = Path(m3serve.__file__).parent
    copy = tmp_path / "src" / "m3serve"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "serving" / "brand_new_module.py").write_text('"""Code that did not exist before."""\nX = 1\n')
    (copy / "serving" / "api_server.py").write_text((copy / "serving" / "api_server.py").read_text() + "\n# edit\n")
    code = ("import sys; from m3serve.model.tiny import make_tiny; from m3serve.model.files import "
            "tiny_model_cache_dir; make_tiny(sys.argv[1], 0); print(tiny_model_cache_dir(0).name)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tiny")], cwd=tmp_path, check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path / "src"),
                                                              "PATH": "/usr/bin:/bin"})
    assert digests(tmp_path / "tiny") == PINNED
    assert out.stdout.strip() == tiny_model_cache_dir(0).name


def test_every_file_of_the_tiny_model_gets_the_same_mode(tmp_path):
    """The weights are as readable as the other files (the umask decides, as for any file a
    process writes): the default model lives in a cache other users and containers share."""
    import os
    import stat
    modes = {f.name: stat.S_IMODE(os.stat(f).st_mode) for f in make_tiny(tmp_path / "tiny", seed=0).iterdir()}
    umask = os.umask(0)
    os.umask(umask)
    assert modes["model.safetensors"] == 0o666 & ~umask, modes
    assert set(modes.values()) == {modes["config.json"]}, modes
