"""Structured outputs on the sampling rank: grammars compiled with xgrammar (vLLM's default
backend) from the tokenizer's vocabulary, one matcher per constrained request, and the token
mask applied to its logits before every sampled token.

`compile_grammar` is also what the engine calls when a request arrives, so an invalid schema,
regex or grammar is refused there (ValueError naming it) and never reaches a step. Compiled
grammars are cached per process by the request's `StructuredOutputsParams.key()`.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import torch

from m3serve.sampling_params import StructuredOutputsParams


def _xgr():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"structured outputs need xgrammar: pip install xgrammar ({e})") from None
    return xgrammar


@lru_cache(maxsize=8)
def _compiler(tokenizer_dir: str, vocab_size: int, stop_ids: tuple[int, ...]):
    """A grammar compiler over the model's vocabulary (`vocab_size` rows of logits; the
    tokenizer's tokens fill the first ones)."""
    from tokenizers import Tokenizer

    xgr = _xgr()
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    encoded = [""] * tokenizer.get_vocab_size(with_added_tokens=True)
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        encoded[index] = token
    info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                             stop_token_ids=list(stop_ids), add_prefix_space=False)
    return xgr.GrammarCompiler(info, cache_enabled=True)


def compile_grammar(params, tokenizer_dir, vocab_size: int):
    """The compiled grammar of a request's `structured_outputs` (its stop tokens end it);
    ValueError naming what is wrong with it."""
    stop_ids = tuple(sorted(params.all_stop_token_ids))
    if not stop_ids:
        raise ValueError("structured_outputs needs a stop token to end the output: not with ignore_eos "
                         "and no stop_token_ids")
    if params.min_tokens > 0:
        raise ValueError("structured_outputs cannot be combined with min_tokens: the grammar decides "
                         "where the output ends (its stop token cannot wait for min_tokens)")
    return _compile(params.structured_outputs, str(tokenizer_dir), vocab_size, stop_ids)


_CACHE: dict = {}


def _compile(spec: StructuredOutputsParams, tokenizer_dir: str, vocab_size: int, stop_ids: tuple[int, ...]):
    key = (spec.key(), tokenizer_dir, vocab_size, stop_ids)
    if key in _CACHE:
        return _CACHE[key]
    compiler = _compiler(tokenizer_dir, vocab_size, stop_ids)
    any_ws = not spec.disable_any_whitespace
    try:
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            json.loads(schema)
            grammar = compiler.compile_json_schema(schema, any_whitespace=any_ws)
        elif spec.json_object:               # any JSON object (an array or a number is not one)
            grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_ws)
        elif spec.regex is not None:
            grammar = compiler.compile_regex(spec.regex)
        elif spec.choice is not None:
            grammar = compiler.compile_regex("|".join(f"({re.escape(c)})" for c in spec.choice))
        else:
            grammar = compiler.compile_grammar(spec.grammar)
    except Exception as e:      # xgrammar's parse errors are RuntimeErrors of several kinds
        what = _constraint_name(spec)
        detail = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e).strip().splitlines()[0])   # no C++ source path
        raise ValueError(f"structured_outputs.{what} is not valid: {detail[:300]}") from None
    if not _allows_a_first_token(grammar, vocab_size):
        raise ValueError(f"structured_outputs.{_constraint_name(spec)} matches no output: not even its "
                         f"first token can be sampled")
    if len(_CACHE) > 256:
        _CACHE.clear()
    _CACHE[key] = grammar
    return grammar


def _constraint_name(spec: StructuredOutputsParams) -> str:
    """The one constraint field the request set (json, regex, choice, grammar or json_object)."""
    return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(spec, k) not in (None, False))


def _allows_a_first_token(grammar, vocab_size: int) -> bool:
    """Whether a fresh matcher of `grammar` allows any token (a stop token included)."""
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)      # [1, ceil(V / 32)] int32 bits
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


class GrammarBook:
    """The matchers of this rank's constrained requests (created on first use, dropped with
    their row) and the masks they put on logits."""

    def __init__(self, tokenizer_dir, vocab_size: int):
        self.tokenizer_dir, self.vocab_size = str(tokenizer_dir), vocab_size
        self._matchers: dict = {}

    def mask(self, logits: torch.Tensor, req_ids: list[str], params: list) -> None:
        """logits [R, V] fp32 of the rows being sampled: tokens a row's grammar forbids get -inf."""
        rows = [i for i, p in enumerate(params) if p.structured_outputs is not None]
        if not rows:
            return
        xgr = _xgr()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for slot, i in enumerate(rows):
            self._matcher(req_ids[i], params[i]).fill_next_token_bitmask(bitmask, slot)
        index = torch.tensor(rows, device=logits.device)
        sub = logits[index]                     # [len(rows), V], a copy
        xgr.apply_token_bitmask_inplace(sub, bitmask.to(sub.device))
        logits[index] = sub

    def accept(self, req_id: str, params, token: int) -> bool:
        """Advance the request's grammar by its sampled token; False when the grammar does not
        allow it (every token was masked: the grammar reached a dead end)."""
        if params.structured_outputs is None:
            return True
        matcher = self._matcher(req_id, params)
        return matcher.is_terminated() or matcher.accept_token(token)

    def drop(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)

    def _matcher(self, req_id: str, params):
        matcher = self._matchers.get(req_id)
        if matcher is None:
            grammar = compile_grammar(params, self.tokenizer_dir, self.vocab_size)
            matcher = self._matchers[req_id] = _xgr().GrammarMatcher(grammar)
        return matcher
