"""Benchmark datasets: the random-token workload of `m3serve bench serve`.

Owns the per-request length sampling (both range-ratio conventions of docs/benchmarks.md), the
tokenizer loading, and the prompt builder that turns random token ids into text that
re-tokenizes to the requested length. Everything is seeded and deterministic.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

RANGE_RATIO_MODES = ("inferencex", "vllm")
# Rounds of decode -> re-encode -> trim/pad before accepting an approximate length.
_MAX_REFIT_ROUNDS = 10


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt text and the lengths it stands for.

    `prompt_len` is the token count of `prompt` re-encoded by the benchmark tokenizer (what the
    server will see, before any chat template); `expected_output_len` is sent as max_tokens.
    `messages`, when set, is the whole chat conversation a chat request sends instead of one
    user message holding `prompt` (the agentic workload's turns).
    """

    prompt: str
    prompt_len: int
    expected_output_len: int
    messages: list[dict] | None = None
    images: tuple[str, ...] = ()      # data URLs sent as image_url parts (chat only)


def length_bounds(length: int, range_ratio: float, mode: str) -> tuple[int, int]:
    """Inclusive [low, high] range of per-request lengths for nominal `length`.

    mode "inferencex": [floor(r*L), L] (InferenceX; r = 0.8 for the workload of record).
    mode "vllm":       [floor(L*(1-r)), ceil(L*(1+r))] (upstream `--random-range-ratio`).
    The low end is clamped to 1 so that no request asks for an empty prompt or output.
    """
    if mode not in RANGE_RATIO_MODES:
        raise ValueError(f"range_ratio_mode must be one of {RANGE_RATIO_MODES}, got {mode!r}")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if mode == "inferencex":
        if not 0.0 <= range_ratio <= 1.0:
            raise ValueError(
                f"range_ratio must be in [0, 1] for mode 'inferencex', got {range_ratio}")
        low, high = math.floor(range_ratio * length), length
    else:
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1) for mode 'vllm', got {range_ratio}")
        low = math.floor(length * (1.0 - range_ratio))
        high = math.ceil(length * (1.0 + range_ratio))
    return max(low, 1), max(high, 1)


def sample_lengths(num_requests: int, input_len: int, output_len: int, range_ratio: float,
                   mode: str = "inferencex",
                   seed: int = 0) -> tuple[list[int], list[int]]:
    """Per-request (input_lens, output_lens), each uniform over its `length_bounds` range."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    in_low, in_high = length_bounds(input_len, range_ratio, mode)
    out_low, out_high = length_bounds(output_len, range_ratio, mode)
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    return [int(n) for n in input_lens], [int(n) for n in output_lens]


def load_tokenizer(path: str | os.PathLike):
    """Load a `tokenizers.Tokenizer` from a directory holding tokenizer.json, or from the file.

    Raises ValueError naming the path when it cannot be loaded.
    """
    from tokenizers import Tokenizer

    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        return Tokenizer.from_file(file)
    except Exception as exc:  # noqa: BLE001 -- any failure means "not a usable tokenizer"
        raise ValueError(f"cannot load tokenizer from {path!r}: {exc}") from exc


class TokenizerView:
    """Uniform encode/decode/vocabulary over a `tokenizers.Tokenizer` or any object with
    encode/decode (e.g. a transformers tokenizer). Encoding never adds special tokens."""

    def __init__(self, tokenizer: Any):
        if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
            raise ValueError(f"tokenizer must have encode and decode, got {type(tokenizer)!r}")
        self._tok = tokenizer
        self.vocab_size = self._vocab_size(tokenizer)
        special = self._special_ids(tokenizer)
        allowed = np.setdiff1d(np.arange(self.vocab_size), np.array(sorted(special), dtype=int))
        if allowed.size == 0:
            raise ValueError("tokenizer has no non-special tokens to build prompts from")
        self.allowed_ids = allowed  # [num_allowed]
        self._filler: int | None | bool = False   # found lazily; None = the tokenizer has none

    def filler(self) -> int | None:
        """A token that re-tokenizes as itself however often it is repeated (" the" in most
        vocabularies): it tops a prompt up to an exact length."""
        if self._filler is False:
            self._filler = None
            probes = [self.encode(w) for w in (" the", " a", " and", " x", "a")]
            candidates = [p[0] for p in probes if len(p) == 1] + [int(i) for i in self.allowed_ids[:2000]]
            for t in candidates:
                if all(self.encode(self.decode([t] * n)) == [t] * n for n in (1, 2, 3, 8, 33)):
                    self._filler = t
                    break
        return self._filler

    @staticmethod
    def _vocab_size(tok: Any) -> int:
        if hasattr(tok, "get_vocab_size"):
            return int(tok.get_vocab_size(with_added_tokens=True))
        if hasattr(tok, "__len__"):
            return len(tok)
        if getattr(tok, "vocab_size", None) is not None:
            return int(tok.vocab_size)
        raise ValueError(f"cannot tell the vocabulary size of tokenizer {type(tok)!r}")

    @staticmethod
    def _special_ids(tok: Any) -> set[int]:
        # Special tokens in a random prompt would turn into control tokens (EOS, roles) on the
        # server side, so prompts are drawn from the ordinary vocabulary only.
        if hasattr(tok, "get_added_tokens_decoder"):
            return {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        return set(getattr(tok, "all_special_ids", []) or [])

    def encode(self, text: str) -> list[int]:
        try:
            out = self._tok.encode(text, add_special_tokens=False)
        except TypeError:
            out = self._tok.encode(text)
        return list(out.ids) if hasattr(out, "ids") else list(out)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def build_prompt(view: TokenizerView, length: int, rng: np.random.Generator) -> tuple[str, int]:
    """Text that re-tokenizes to exactly `length` tokens, and that count.

    Random ids are decoded, re-encoded, then trimmed or topped up with fresh random ids until
    the round trip is stable at `length` (usually one or two rounds); if it does not settle, the
    tail is made of a filler token that never merges with its neighbours. (Only a tokenizer
    without any such token can give another length; the count returned is then the true one.)
    """
    ids = list(rng.choice(view.allowed_ids, size=length))
    for _ in range(_MAX_REFIT_ROUNDS):
        text = view.decode(ids)
        actual = view.encode(text)
        if len(actual) == length:
            return text, length
        if len(actual) > length:
            ids = actual[:length]
        else:
            ids = actual + list(rng.choice(view.allowed_ids, size=length - len(actual)))
    # Still off by a token or two where random pieces merge: keep the random head and end on
    # filler tokens, which never merge, until the length is exact.
    filler = view.filler()
    if filler is not None:
        head = view.encode(view.decode(ids))
        for pad in range(1, min(length, 16) + 1):
            text = view.decode(head[:length - pad] + [filler] * pad)
            if len(view.encode(text)) == length:
                return text, length
        text = view.decode([filler] * length)
        if len(view.encode(text)) == length:
            return text, length
    text = view.decode(ids)
    return text, len(view.encode(text))


def sample_random_requests(tokenizer: Any, num_requests: int, input_len: int, output_len: int,
                           range_ratio: float, range_ratio_mode: str = "inferencex",
                           seed: int = 0) -> list[SampleRequest]:
    """The random dataset: `num_requests` prompts of random tokens with sampled lengths.

    Input and output lengths follow `length_bounds(.., range_ratio, range_ratio_mode)`; the same
    arguments always give the same requests.
    """
    view = tokenizer if isinstance(tokenizer, TokenizerView) else TokenizerView(tokenizer)
    input_lens, output_lens = sample_lengths(num_requests, input_len, output_len, range_ratio,
                                             range_ratio_mode, seed)
    # A separate stream for token ids keeps the lengths independent of prompt construction.
    rng = np.random.default_rng([seed, 1])
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        prompt, prompt_len = build_prompt(view, n_in, rng)
        requests.append(SampleRequest(prompt, prompt_len, n_out))
    return requests


def parse_image_sizes(text: str) -> list[tuple[int, int]]:
    """"672x672,1920x1080" -> [(672, 672), (1920, 1080)] (width x height)."""
    sizes = []
    for item in text.split(","):
        try:
            w, h = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"image size {item!r} is not WIDTHxHEIGHT") from None
        if w < 1 or h < 1:
            raise ValueError(f"image size {item!r} must be positive")
        sizes.append((w, h))
    return sizes


def random_image_url(width: int, height: int, rng: np.random.Generator) -> str:
    """A data URL of a JPEG of random pixels (needs Pillow)."""
    import base64
    import io

    from PIL import Image
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def add_random_images(requests: list[SampleRequest], items_per_request: int, sizes: list[tuple[int, int]],
                      seed: int = 0) -> list[SampleRequest]:
    """The random-mm dataset (vLLM's name): each request of the random dataset with
    `items_per_request` random images, each of a size drawn from `sizes`. Images repeat across
    requests only by chance of identical pixels, so the prefix cache never shares them."""
    import dataclasses
    rng = np.random.default_rng([seed, 2])
    out = []
    for r in requests:
        images = tuple(random_image_url(*sizes[rng.integers(len(sizes))], rng) for _ in range(items_per_request))
        out.append(dataclasses.replace(r, images=images))
    return out
