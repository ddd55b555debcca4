"""The tiny models stay put: `make_tiny` (the random one) with one seed writes the same bytes on
every machine and at every commit (its tokenizer is stored, not trained on the package's code),
and the embedded trained one is the shipped files, pinned here."""
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import m3serve
from m3serve.model.files import default_model_dir
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


# sha256 of the embedded trained model's files (scripts/train_tiny.py; its model card and report
# are left out). Change them only on purpose: new values are a new default model.
TRAINED = {
    "chat_template.jinja": "57462af8001049cbda3dd9f8bc0cda648465304d7d104865fbdb51ec1a026407",
    "config.json": "75da1ad78fa92be90a160b0cd25ad5b3ec6b2b8e744773d6f4ef0fc8c4f5ac7b",
    "corpus.json": "5fc549f9ee7dcc5a09364815018b57c3ae15e1ddeb2915d53221dbdb24d5188c",
    "dspark/config.json": "5a8db5f96172f38349895a04c6f541472f008398a6b26a5feb138ad0b02c1902",
    "dspark/model.safetensors": "de42c3bb1587394e406f29e20a7969ae55c07e9e46a434d1874f78781d8dd308",
    "eagle3/config.json": "f08a17a75b912078629b7327abf41e9722a5214e55096432e4bf616a95462a0d",
    "eagle3/model.safetensors": "6fec618718631f09e06131a98ec4683a5ab1da39a969d5b5c3b6d9e07b702e31",
    "generation_config.json": "ed59f0e88cbcd2514438250450fa0c004df54d101ac2b1e43869fb579a69e104",
    "heldout.txt": "95d093f57bcc0540ccdcf00e167d05126f8b11126142eeb02355c1066ad0d2d0",
    "model.safetensors": "2dd5fc64ecaa9b04d9f27038d12db607b8b7bea4142e2feb49254eb441f9beeb",
    "mtp.safetensors": "cec20f10304df338365dda48b48be65a1839f00857cee6ea25042daf6399044d",
    "tokenizer.json": "bf0aef49926c0c27267b63a9f4e4df3518d22119dc1fa0ff54c2edf7ea4cf6ed",
    "tokenizer_config.json": "d9c8cb9cfbef1e8e2cdcb59618883df76b8327b4a65c8e46392335b5040d5333",
}


def digests(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


def test_make_tiny_writes_the_pinned_bytes(tmp_path):
    assert digests(make_tiny(tmp_path / "tiny", seed=0)) == PINNED


def test_the_embedded_model_is_the_shipped_trained_checkpoint():
    """The default model is the trained one, with the random model's tokenizer files byte for byte
    (so a prompt is the same tokens on either, and the agent-client prefill bound holds for both)."""
    root = default_model_dir()
    files = {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(root.rglob("*")) if p.is_file() and p.name not in ("MODEL_CARD.md", "training_report.json")}
    assert files == TRAINED
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert TRAINED[name] == PINNED[name]


def test_new_code_in_the_package_does_not_change_the_random_model(tmp_path):
    package = Path(m3serve.__file__).parent
    copy = tmp_path / "src" / "m3serve"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "serving" / "brand_new_module.py").write_text('"""Code that did not exist before."""\nX = 1\n')
    (copy / "serving" / "api_server.py").write_text((copy / "serving" / "api_server.py").read_text() + "\n# edit\n")
    code = "import sys; from m3serve.model.tiny import make_tiny; make_tiny(sys.argv[1], 0)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "tiny")], cwd=tmp_path, check=True,
                   capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path / "src"), "PATH": "/usr/bin:/bin"})
    assert digests(tmp_path / "tiny") == PINNED


def test_every_file_of_the_tiny_model_gets_the_same_mode(tmp_path):
    """The weights are as readable as the other files (the umask decides, as for any file a
    process writes): make-tiny's folders are shared between users and containers."""
    import os
    import stat
    modes = {f.name: stat.S_IMODE(os.stat(f).st_mode) for f in make_tiny(tmp_path / "tiny", seed=0).iterdir()}
    umask = os.umask(0)
    os.umask(umask)
    assert modes["model.safetensors"] == 0o666 & ~umask, modes
    assert set(modes.values()) == {modes["config.json"]}, modes
