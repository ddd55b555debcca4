"""Builds the tiny model's tokenizer: a real byte-level BPE trained at build time.

The training text is fixed and ships with the package (`tiny_corpus.md`, a snapshot of the
project's docs, plus the prose and pseudo-words below), so the result does not depend on the
code around it and needs no download. The default tiny model does not even retrain: its
2048-token tokenizer is stored (`tiny_tokenizer.json`, made by `build_tokenizer` with that
corpus) and written as is, so its bytes cannot drift with the `tokenizers` library either. The MiniMax-M3 marker
strings (docs/model.md §1.6) are appended as added tokens with fixed ids at the end of the vocab.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# The default tiny model's tokenizer: build_tokenizer(dir, 2048) on the shipped corpus, stored.
STORED_TOKENIZER = Path(__file__).resolve().parent / "tiny_tokenizer.json"

# Marker strings in id order; they take the last len(SPECIAL_TOKENS) ids of the vocabulary.
SPECIAL_TOKENS: dict[str, str] = {
    "bos": "]~b]",
    "eos": "[e~[",
    "bod": "]~!b[",
    "think_start": "<mm:think>",
    "think_end": "</mm:think>",
    "tool_namespace": "]<]minimax[>[",
    "image": "]<]image[>[",
    "video": "]<]video[>[",
    "image_start": "]<]start of image[>[",
    "image_end": "]<]end of image[>[",
}

# Markers the reasoning and tool parsers match as text must survive `skip_special_tokens=True`
# decoding, so they are ordinary added tokens; the rest are special (dropped when skipping).
_TEXT_MARKERS = frozenset({"think_start", "think_end", "tool_namespace"})

_PROSE = """\
MiniMax-M3 is a large mixture-of-experts language model with sparse attention and a context of
one million tokens. A serving engine keeps the key and value cache in fixed-size blocks, admits
new requests while others are still decoding, and streams the generated text back to the client
as soon as each token is sampled. The scheduler decides, at every step, how many tokens each
request may compute; long prompts are split into chunks so that decoding requests are never
starved. When the answer is complete, the request's blocks are freed and may be reused at once.
Users talk to the server through an OpenAI-compatible interface: they send a list of messages,
optional tools described by JSON schemas, and sampling parameters such as temperature, top-p and
the maximum number of tokens. The quick brown fox jumps over the lazy dog; pack my box with five
dozen liquor jugs. Numbers like 0, 1, 2, 3.14, 42, 128, 2048 and 1,048,576 appear often.
"""

_SYLLABLES = (
    "a e i o u an en in on un ar er ir or ur al el il ol ul at et it ot ut "
    "ba be bi bo bu ca ce ci co cu da de di do du fa fe fi fo ga ge go ha he hi ho "
    "ka ke ki ko la le li lo lu ma me mi mo mu na ne ni no nu pa pe pi po ra re ri ro ru "
    "sa se si so su ta te ti to tu va ve vi vo wa we wi xa ya yo za ze th sh ch st tr pr "
    "ing ion tion ment ness able ous ive est ed ly"
).split()


def _corpus_texts() -> list[str]:
    """The fixed training text that ships with the package, one paragraph per item."""
    text = (Path(__file__).resolve().parent / "tiny_corpus.md").read_text(encoding="utf-8")
    return [p for p in text.split("\n\n") if p.strip()]


def _synthetic_texts(num_words: int) -> list[str]:
    """Deterministic pseudo-words and numbers: guarantees enough distinct pairs to reach any vocab."""
    rng = random.Random(20260101)
    lines = []
    for start in range(0, num_words, 16):
        words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 5))) for _ in range(16)]
        lines.append(" ".join(words) + f" {start} {start * 7919 % 100003}.")
    return lines


def _train(texts: list[str], num_bpe_tokens: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_bpe_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _train_exact(num_bpe_tokens: int) -> Tokenizer:
    """Trains until the BPE vocabulary holds exactly num_bpe_tokens entries."""
    base = _corpus_texts() + [_PROSE]
    num_words = num_bpe_tokens
    while True:
        tokenizer = _train(base + _synthetic_texts(num_words), num_bpe_tokens)
        if tokenizer.get_vocab_size() == num_bpe_tokens:
            return tokenizer
        num_words *= 2  # corpus ran out of pairs to merge: add more pseudo-words and retrain


def _load_template_text() -> str:
    return (Path(__file__).resolve().parent / "chat_template.jinja").read_text(encoding="utf-8")


def build_tokenizer(out_dir: str | Path, vocab_size: int = 2048, *, model_max_length: int = 1_048_576) -> None:
    """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja into out_dir.

    The vocabulary has exactly `vocab_size` entries: byte-level BPE tokens first, then the
    SPECIAL_TOKENS markers at ids `vocab_size - len(SPECIAL_TOKENS)` … `vocab_size - 1`.
    Two calls give byte-identical files (with the same `tokenizers` version).
    """
    min_vocab = 256 + len(SPECIAL_TOKENS)  # every byte needs a token, then the markers
    if not isinstance(vocab_size, int) or vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be an int >= {min_vocab}, got {vocab_size!r}")
    num_bpe_tokens = vocab_size - len(SPECIAL_TOKENS)
    tokenizer = _train_exact(num_bpe_tokens)
    _add_markers(tokenizer, num_bpe_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    _write_config(out, model_max_length)


def write_tiny_tokenizer(out_dir: str | Path) -> None:
    """The default tiny model's tokenizer: the stored 2048-token file, byte for byte, and its
    config and chat template as `build_tokenizer` writes them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_bytes(STORED_TOKENIZER.read_bytes())
    _write_config(out, 1_048_576)


def _add_markers(tokenizer: Tokenizer, num_bpe_tokens: int) -> None:
    for name, content in SPECIAL_TOKENS.items():
        token = AddedToken(content, special=name not in _TEXT_MARKERS, normalized=False)
        if name in _TEXT_MARKERS:
            tokenizer.add_tokens([token])
        else:
            tokenizer.add_special_tokens([token])
    for offset, content in enumerate(SPECIAL_TOKENS.values()):
        if tokenizer.token_to_id(content) != num_bpe_tokens + offset:
            raise RuntimeError(f"marker {content!r} did not land on id {num_bpe_tokens + offset}")


def _write_config(out: Path, model_max_length: int) -> None:
    template = _load_template_text()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS["bos"],
        "eos_token": SPECIAL_TOKENS["eos"],
        "pad_token": SPECIAL_TOKENS["eos"],  # no dedicated pad string in M3; padding is masked anyway
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    config_text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")


def special_token_ids(tokenizer_dir: str | Path) -> dict[str, int]:
    """Maps each SPECIAL_TOKENS name ("bos", "eos", "think_start", ...) to its id in tokenizer_dir."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json in {str(tokenizer_dir)!r}")
    tokenizer = Tokenizer.from_file(str(path))
    ids = {}
    for name, content in SPECIAL_TOKENS.items():
        token_id = tokenizer.token_to_id(content)
        if token_id is None:
            raise ValueError(f"tokenizer in {str(tokenizer_dir)!r} lacks the {name} marker {content!r}")
        ids[name] = token_id
    return ids
