"""Structured outputs on the sampling rank: grammars compiled with xgrammar (vLLM's default
backend) from the tokenizer's vocabulary, one matcher per constrained request, and the token
mask applied to its logits before every sampled token.

`GrammarCompiles` compiles the grammars of arriving requests on threads of its own, never on
the engine loop: a request waits for its grammar in the scheduler while the others run, and an
invalid, oversized or too slow grammar fails that request only. The compiled grammar is handed
to the `GrammarBook` of the same process (the engine process is the sampling rank). Compiled
grammars are also cached per process by the request's `StructuredOutputsParams.key()`.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import torch

from m3serve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# A grammar whose normalized EBNF text is longer than this is refused before it is compiled:
# compile time and memory grow with the grammar's positions times the vocabulary, and a thread
# that compiles cannot be stopped.
MAX_GRAMMAR_CHARS = 1 << 18
# Threads that compile at once (past the bound, compilations queue; each request's time bound
# counts from its arrival).
MAX_COMPILE_THREADS = 8


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
    check_request(params)
    return _compile(params.structured_outputs, str(tokenizer_dir), vocab_size,
                    tuple(sorted(params.all_stop_token_ids)))


_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


def parse_constraint(spec: StructuredOutputsParams):
    """The constraint as an xgrammar `Grammar` (parsed, not compiled: quick, and independent of
    the vocabulary); ValueError naming the field when it is invalid or larger than
    MAX_GRAMMAR_CHARS."""
    xgr = _xgr()
    any_ws = not spec.disable_any_whitespace
    try:
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            json.loads(schema)
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_ws)
        elif spec.json_object:               # any JSON object (an array or a number is not one)
            grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_ws)
        elif spec.regex is not None:
            grammar = xgr.Grammar.from_regex(spec.regex)
        elif spec.choice is not None:
            grammar = xgr.Grammar.from_regex("|".join(f"({_regex_literal(c)})" for c in spec.choice))
        else:
            grammar = xgr.Grammar.from_ebnf(spec.grammar)
    except Exception as e:      # xgrammar's parse errors are RuntimeErrors of several kinds
        detail = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e).strip().splitlines()[0])   # no C++ source path
        raise ValueError(f"{spec.field_name} is not valid: {detail[:300]}") from None
    size = len(str(grammar))
    if size > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{spec.field_name} is too large to compile: its grammar "
                         f"has {size} characters, the limit is {MAX_GRAMMAR_CHARS}")
    return grammar


def _compile(spec: StructuredOutputsParams, tokenizer_dir: str, vocab_size: int, stop_ids: tuple[int, ...]):
    key = (spec.key(), tokenizer_dir, vocab_size, stop_ids)
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
    grammar = parse_constraint(spec)
    compiler = _compiler(tokenizer_dir, vocab_size, stop_ids)
    try:
        grammar = compiler.compile_grammar(grammar)
    except Exception as e:
        raise ValueError(f"{spec.field_name} could not be compiled: "
                         f"{str(e).strip()[:300]}") from None
    if not _allows_a_first_token(grammar, vocab_size):
        raise ValueError(f"{spec.field_name} matches no output: not even its "
                         f"first token can be sampled")
    with _CACHE_LOCK:
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = grammar
    return grammar


def check_request(params) -> None:
    """What can be refused at once, before any compiling (ValueError naming it)."""
    if not params.all_stop_token_ids:
        raise ValueError("structured_outputs needs a stop token to end the output: not with ignore_eos "
                         "and no stop_token_ids")
    if params.min_tokens > 0:
        raise ValueError("structured_outputs cannot be combined with min_tokens: the grammar decides "
                         "where the output ends (its stop token cannot wait for min_tokens)")


# Request id -> its compiled grammar, from GrammarCompiles to the GrammarBook of this process.
_READY: dict = {}


class GrammarCompiles:
    """The grammars of arriving requests, compiled on up to MAX_COMPILE_THREADS threads
    (xgrammar releases the GIL while it compiles, so the engine loop keeps stepping).

    `submit` starts one; `poll` reports the ones that are over: ready (handed to the
    GrammarBook), invalid, or not compiled within `timeout_s` of their arrival. A thread that
    compiles cannot be stopped: a request past its bound fails, its compilation finishes in the
    background, and MAX_GRAMMAR_CHARS bounds what it costs. At start-up the xgrammar import
    (which pulls in transformers: seconds on a busy host), the compiler over the vocabulary and
    a tool-call grammar's shared parts are warmed on the same threads."""

    def __init__(self, tokenizer_dir, vocab_size: int, eos_token_id: int | None, timeout_s: float):
        self.tokenizer_dir, self.vocab_size, self.timeout_s = str(tokenizer_dir), vocab_size, timeout_s
        self._pool = ThreadPoolExecutor(MAX_COMPILE_THREADS, thread_name_prefix="m3serve-grammar")
        self._jobs: dict[str, tuple[Future, float]] = {}     # request id -> (compilation, deadline)
        self._running: dict[tuple, Future] = {}    # grammar key -> its compilation (shared by n > 1)
        self.warm = self._pool.submit(_warm_up, self.tokenizer_dir, vocab_size, eos_token_id)

    @property
    def num_pending(self) -> int:
        return len(self._jobs)

    def submit(self, request_id: str, params) -> None:
        key = (params.structured_outputs.key(), tuple(sorted(params.all_stop_token_ids)))
        future = self._running.get(key)
        if future is None or future.done():
            future = self._running[key] = self._pool.submit(compile_grammar, params, self.tokenizer_dir,
                                                            self.vocab_size)
        self._jobs[request_id] = (future, time.monotonic() + self.timeout_s)

    def poll(self) -> list[tuple[str, str | None, bool]]:
        """(request id, error or None, whether the error is the client's) of the compilations
        that are over since the last call."""
        now, over = time.monotonic(), []
        self._running = {key: future for key, future in self._running.items() if not future.done()}
        for request_id, (future, deadline) in list(self._jobs.items()):
            if future.done():
                del self._jobs[request_id]
                error = future.exception()
                if error is None:
                    _READY[request_id] = future.result()
                    over.append((request_id, None, True))
                elif isinstance(error, ValueError):
                    over.append((request_id, str(error), True))
                else:
                    logger.error("compiling the grammar of request %s failed: %r", request_id, error)
                    over.append((request_id, f"compiling its grammar failed: {type(error).__name__}: {error}",
                                 False))
            elif now > deadline:
                del self._jobs[request_id]
                if not any(f is future for f, _ in self._jobs.values()):
                    future.cancel()      # still queued and wanted by no one else: it never starts
                over.append((request_id, f"its structured_outputs grammar did not compile within "
                                         f"{self.timeout_s:g} s (--grammar-compile-timeout-seconds): "
                                         f"simplify the schema or grammar", True))
        return over

    def release(self, request_id: str) -> None:
        """The request is over (aborted or finished): forget it."""
        self._jobs.pop(request_id, None)
        _READY.pop(request_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _warm_up(tokenizer_dir: str, vocab_size: int, eos_token_id: int | None) -> None:
    """Import xgrammar, build the compiler for the default stop token and compile a tool-call
    grammar, so that the first constrained request pays none of it."""
    from m3serve.structured.tool_grammar import tool_call_grammar

    started = time.monotonic()
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}
    if eos_token_id is None:
        return
    try:
        spec = StructuredOutputsParams(grammar=tool_call_grammar([tool], "required", None))
        _compile(spec, tokenizer_dir, vocab_size, (eos_token_id,))
    except Exception:
        logger.exception("warming the grammar compiler failed (the first constrained request will "
                         "compile from cold)")
        return
    logger.debug("grammar compiler warm in %.2f s", time.monotonic() - started)


# Characters with a meaning in xgrammar's regex dialect. Python's re.escape also escapes spaces
# and newlines, escapes xgrammar does not know (it warns, then matches the character).
_REGEX_META = frozenset("\\^$.|?*+()[]{}-/")


def _regex_literal(text: str) -> str:
    """A regex matching exactly `text` in xgrammar's dialect."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


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

    def warm_up(self, device: torch.device) -> None:
        """Apply one mask on a GPU now: xgrammar compiles its kernel on first use, which would
        otherwise stall the step of the first constrained request."""
        if device.type != "cuda":
            return
        try:
            xgr = _xgr()
            logits = torch.zeros(2, self.vocab_size, device=device)          # [2, V]
            bitmask = xgr.allocate_token_bitmask(2, self.vocab_size).to(device)
            xgr.apply_token_bitmask_inplace(logits[:1], bitmask[:1])
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=[1])     # verify steps' rows
        except Exception:
            logger.warning("warming the grammar mask kernel failed; the first constrained step compiles it",
                           exc_info=True)

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

    def verify_masks(self, num_rows: int, req_ids: list[str], params: list, drafts: list[list[int]],
                     first_rows: list[int], device: torch.device):
        """The grammar masks of a verify step, for logits [num_rows, V]: request i's verified
        positions are rows first_rows[i] + j, j = 0 .. len(drafts[i]) (its last token, then
        each draft). -> (bitmask [num_rows, ceil(V / 32)] int32 on `device`, the rows that carry
        a mask), or None when no request is constrained.

        Row j of a constrained request gets its grammar's mask after its first j drafts: the
        matcher accepts them tentatively while the rows are filled and is rolled back after, so
        it is left where it was (`accept` advances it over the tokens that are kept). Rows that
        no kept token can come from get no mask: those after a draft the grammar refuses (the
        row before masks that draft out, so it and every draft after it are rejected) and those
        after the grammar's end (its stop token ends the request)."""
        rows: list[int] = []
        bitmask = None
        for req_id, p, d, first in zip(req_ids, params, drafts, first_rows):
            if p.structured_outputs is None:
                continue
            if bitmask is None:
                bitmask = _xgr().allocate_token_bitmask(num_rows, self.vocab_size)   # all allowed
            matcher = self._matcher(req_id, p)
            taken = 0
            for j in range(len(d) + 1):
                if matcher.is_terminated():      # past the stop token: no mask to fill
                    break
                matcher.fill_next_token_bitmask(bitmask, first + j)
                rows.append(first + j)
                if j == len(d) or not matcher.accept_token(d[j]):
                    break
                taken += 1
            if taken:
                matcher.rollback(taken)
        if bitmask is None:
            return None
        return bitmask.to(device, non_blocking=True), rows

    @staticmethod
    def apply(logits: torch.Tensor, masks) -> None:
        """Apply `verify_masks`' masks to logits [num_rows, V] fp32, in place (-inf where a
        row's grammar forbids the token)."""
        bitmask, rows = masks
        if rows:
            _xgr().apply_token_bitmask_inplace(logits, bitmask, indices=rows)

    def accept(self, req_id: str, params, token: int) -> bool:
        """Advance the request's grammar by its sampled token; False when the grammar does not
        allow it (every token was masked: the grammar reached a dead end)."""
        if params.structured_outputs is None:
            return True
        matcher = self._matcher(req_id, params)
        return matcher.is_terminated() or matcher.accept_token(token)

    def drop(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)
        _READY.pop(req_id, None)

    def _matcher(self, req_id: str, params):
        matcher = self._matchers.get(req_id)
        if matcher is None:
            grammar = _READY.pop(req_id, None)
            if grammar is None:     # not compiled by GrammarCompiles (a runner driven directly)
                grammar = compile_grammar(params, self.tokenizer_dir, self.vocab_size)
            matcher = self._matchers[req_id] = _xgr().GrammarMatcher(grammar)
        return matcher
