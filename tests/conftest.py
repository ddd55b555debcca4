"""Shared test fixtures: the tiny checkpoint (written once per session), transformers reference
fixtures built from it, and the gpu marker."""
import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

# Triton kernels run under the interpreter on machines without a GPU; this must be set before
# triton is first imported anywhere in the test process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent / "model"))


def _import_torchvision_without_its_operators() -> None:
    """transformers imports torchvision wherever it is installed (its vision models and image
    processors). A torchvision wheel built for another torch (PyPI's CUDA build beside the CPU
    torch, as .ci/run installs it) fails at import while registering its compiled operators,
    which no test calls: import it once here with that registration skipped, so that every later
    import in this process finds it."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return
    except RuntimeError:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        with mock.patch.object(torch.library, "register_fake", lambda *a, **k: (lambda f: f)):
            import torchvision  # noqa: F401


_import_torchvision_without_its_operators()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from m3serve.model.tiny import make_tiny
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_m31_dir(tmp_path_factory) -> Path:
    """The tiny model in MiniMax-M3.1-Flash's flavor: MSA (and an index cache) in every layer."""
    from m3serve.model.tiny import make_tiny
    return make_tiny(tmp_path_factory.mktemp("tiny_m31"), seed=0, flavor="m3.1-flash")


@pytest.fixture(scope="session")
def hf_checkpoints(tiny_dir, tmp_path_factory):
    """transformers models built from the tiny checkpoint, saved both ways.

    Returns (hf_text_model fp32, dir in transformers' names, dir in original names).
    """
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLForCausalLM)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    vl = MiniMaxM3SparseForConditionalGeneration.from_pretrained(str(tiny_dir), dtype=torch.float32)
    text = MiniMaxM3VLForCausalLM(vl.config.text_config)
    text.model.load_state_dict(vl.model.language_model.state_dict())
    text.lm_head.load_state_dict(vl.lm_head.state_dict())
    text.eval()
    hf_dir = tmp_path_factory.mktemp("hf_names")
    orig_dir = tmp_path_factory.mktemp("orig_names")
    text.save_pretrained(str(hf_dir))
    vl.save_pretrained(str(orig_dir))
    for d in (hf_dir, orig_dir):  # the engine needs the tokenizer next to the weights
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (d / f).write_bytes((tiny_dir / f).read_bytes())
    return text, hf_dir, orig_dir


@pytest.fixture(scope="session")
def tiny_vision_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint with its small vision tower (`make-tiny --vision`)."""
    from m3serve.model.tiny import make_tiny
    return make_tiny(tmp_path_factory.mktemp("tiny_vision"), seed=0, vision=True)


@pytest.fixture(scope="session")
def quant_dir(tmp_path_factory):
    """quant_dir(fmt, flavor="m3") -> the tiny model written by `make-tiny --quantization fmt
    --flavor flavor` (once per session, format and flavor)."""
    from m3serve.model.tiny import make_tiny
    made = {}

    def get(fmt: str, flavor: str = "m3") -> Path:
        if (fmt, flavor) not in made:
            made[fmt, flavor] = make_tiny(tmp_path_factory.mktemp(f"tiny-{flavor}-{fmt}"), seed=0,
                                          flavor=flavor, quantization=fmt)
        return made[fmt, flavor]
    return get
