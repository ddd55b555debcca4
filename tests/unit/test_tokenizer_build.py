"""Tests for the build-time byte-level BPE tokenizer of the tiny model."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from m3serve.model.tokenizer_build import SPECIAL_TOKENS, build_tokenizer, special_token_ids

REPO_ROOT = Path(__file__).resolve().parents[2]




def test_writes_expected_files_and_config(tokenizer_dir):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    template = (tokenizer_dir / "chat_template.jinja").read_text()
    assert config["bos_token"] == "]~b]"
    assert config["eos_token"] == "[e~["
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == template
    assert "<mm:think>" in template and "]<]minimax[>[<tool_call>" in template
    assert isinstance(config["model_max_length"], int)


@pytest.mark.parametrize("vocab_size", [300, 2048, 5000])
def test_vocab_size_exact_and_markers_at_the_end(tmp_path, vocab_size):
    build_tokenizer(tmp_path, vocab_size=vocab_size)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    ids = special_token_ids(tmp_path)
    first = vocab_size - len(SPECIAL_TOKENS)
    assert list(ids) == list(SPECIAL_TOKENS)
    assert list(ids.values()) == list(range(first, vocab_size))
    # Each marker string encodes to exactly its one id, even inside other text.
    for name, content in SPECIAL_TOKENS.items():
        assert ids[name] in tok.encode(f"x {content} y").ids
        assert tok.encode(content).ids == [ids[name]]


def test_rejects_too_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, vocab_size=100)


def test_deterministic_across_processes(tmp_path):
    # A fresh interpreter (different hash seeds) must produce byte-identical files.
    build_tokenizer(tmp_path / "here")
    code = "import sys; from m3serve.model.tokenizer_build import build_tokenizer; build_tokenizer(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True, cwd=REPO_ROOT)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "there" / name).read_bytes() == (tmp_path / "here" / name).read_bytes(), name


def test_build_is_fast(tmp_path):
    start = time.perf_counter()
    build_tokenizer(tmp_path, vocab_size=2048)
    assert time.perf_counter() - start < 3.0


def test_bpe_actually_merges(tokenizer):
    # A trained BPE compresses English prose well below one token per byte.
    text = "The scheduler decides how many tokens each request may compute at every step."
    assert len(tokenizer.encode(text).ids) < len(text.encode()) / 2


@pytest.mark.parametrize(
    "text",
    [
        "hello world", "naïve café — déjà vu", "数据并行和张量并行", "emoji 😀👍🏽🇫🇷 end",
        "\t tabs\n\nnewlines  ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da",
    ],
)
def test_round_trip_unicode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_special_markers_skip_or_keep(tokenizer, tokenizer_dir):
    ids = special_token_ids(tokenizer_dir)
    seq = [ids["bos"]] + tokenizer.encode("<mm:think>plan</mm:think>answer").ids + [ids["eos"]]
    # bos/eos are special (dropped when skipping); the think markers are text the parsers need.
    assert tokenizer.decode(seq, skip_special_tokens=True) == "<mm:think>plan</mm:think>answer"
    assert tokenizer.decode(seq, skip_special_tokens=False) == "]~b]<mm:think>plan</mm:think>answer[e~["


def test_loads_with_transformers_auto_tokenizer(tokenizer_dir, tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = special_token_ids(tokenizer_dir)
    assert len(hf) == 2048
    assert hf.bos_token_id == ids["bos"] and hf.eos_token_id == ids["eos"]
    text = "Grüße 世界 🚀 ]<]minimax[>[<tool_call>"
    assert hf.encode(text, add_special_tokens=True) == tokenizer.encode(text).ids
    assert hf.decode(hf.encode(text)) == text
    rendered = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("]~b]user\nhi[e~[\n]~b]ai\n")


def test_special_token_ids_errors_on_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        special_token_ids(tmp_path / "nope")
