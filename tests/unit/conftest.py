"""Fixtures shared by the unit tests: a freshly trained tiny tokenizer."""
import pytest
from tokenizers import Tokenizer

from m3serve.model.tokenizer_build import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, vocab_size=2048)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
