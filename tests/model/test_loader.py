"""Checkpoint loading: sharded files with an index, and a clear error for every kind of bad file."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from m3serve.model.loader import load_model


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite(path, fn):
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


KEY = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight"


def test_sharded_checkpoint_with_index_loads_identically(tiny_dir, tmp_path):
    d = tmp_path / "sharded"
    d.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_dir / f, d / f)
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        part = {k: tensors[k] for k in names[i::3]}
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(part, str(d / fname))
        weight_map.update({k: fname for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, _, _ = load_model(tiny_dir, progress=False)
    b, _, _ = load_model(d, progress=False)
    for (n1, p1), (n2, p2) in zip(a.named_parameters(), b.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert a.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("case, needle", [
    ("missing", "missing tensor"),
    ("unexpected", "unexpected tensor 'language_model.model.layers.2.self_attn.extra.weight'"),
    ("wrong_shape", "wrong shape for tensor"),
    ("duplicate_in_index", "duplicate tensor"),
])
def test_bad_tensors_are_named(tiny_dir, tmp_path, case, needle):
    d = copy_ckpt(tiny_dir, tmp_path / case)
    f = d / "model.safetensors"
    if case == "missing":
        rewrite(f, lambda t: t.pop(KEY))
    elif case == "unexpected":
        rewrite(f, lambda t: t.__setitem__("language_model.model.layers.2.self_attn.extra.weight", torch.zeros(3)))
    elif case == "wrong_shape":
        rewrite(f, lambda t: t.__setitem__(KEY, torch.zeros(5, 5, dtype=torch.bfloat16)))
    else:
        save_file({KEY: load_file(str(f))[KEY]}, str(d / "extra.safetensors"))
        weight_map = {k: "model.safetensors" for k in load_file(str(f))}
        weight_map["x"] = "extra.safetensors"
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError) as err:
        load_model(d, progress=False)
    msg = str(err.value)
    assert needle in msg
    if case != "unexpected":
        assert "experts.3.w2" in msg
    if case in ("unexpected", "wrong_shape"):
        assert "model.safetensors" in msg


def test_truncated_and_corrupt_files_are_named(tiny_dir, tmp_path):
    d = copy_ckpt(tiny_dir, tmp_path / "trunc")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"corrupt safetensors file .*model\.safetensors"):
        load_model(d, progress=False)
    f.write_bytes(b"\xff" * 8 + b"{not json" + data[20:200])
    with pytest.raises(ValueError, match=r"corrupt safetensors file .*model\.safetensors"):
        load_model(d, progress=False)


def test_index_listing_a_missing_file(tiny_dir, tmp_path):
    d = copy_ckpt(tiny_dir, tmp_path / "idx")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="gone.safetensors"):
        load_model(d, progress=False)


def test_missing_config_field_and_missing_dir(tiny_dir, tmp_path):
    d = copy_ckpt(tiny_dir, tmp_path / "cfg")
    raw = json.loads((d / "config.json").read_text())
    del raw["text_config"]["hidden_size"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="'hidden_size' is missing"):
        load_model(d, progress=False)
    with pytest.raises(ValueError, match="no such directory"):
        load_model(str(tmp_path / "nope"), progress=False)


def test_make_tiny_is_deterministic(tmp_path):
    from m3serve.cli import main
    assert main(["make-tiny", str(tmp_path / "a"), "--seed", "3"]) == 0
    assert main(["make-tiny", str(tmp_path / "b"), "--seed", "3"]) == 0
    assert main(["make-tiny", str(tmp_path / "c"), "--seed", "4"]) == 0
    for f in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()
