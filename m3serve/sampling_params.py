"""Per-request sampling parameters with OpenAI / vLLM names, defaults and meaning.

`SamplingParams` is the one place user sampling knobs are normalised and validated; every bad
value raises ValueError naming the field and the value, so the API layer can answer HTTP 400
and the engine never sees an invalid request.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field

GREEDY_EPS = 1e-5          # temperatures below this are greedy (argmax), as in vLLM
MAX_LOGPROBS = 20          # OpenAI's cap on top_logprobs; larger values are rejected
_SEED_MIN = -(1 << 63)     # torch.Generator.manual_seed accepts [-2**63, 2**64)
_SEED_MAX = (1 << 64) - 1


def _is_int(value) -> bool:
    # bool is an int subclass in Python; `n=True` is a client bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _as_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _check_int(name: str, value, minimum: int) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): exactly one of `json` (a JSON schema, as an
    object or its text), `regex`, `choice` (the output is one of these strings), `grammar`
    (EBNF), `json_object` (any JSON object). `disable_any_whitespace`: no free whitespace
    between JSON tokens. The grammar is compiled by the engine (an invalid one is refused
    there, naming the problem) and applied as a token mask before every sampled token.
    `source`: the request field that set the constraint (`response_format.json_schema.schema`,
    `guided_json`, ...), which the engine's errors name; None: `structured_outputs.<kind>`."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    source: str | None = None

    @property
    def field_name(self) -> str:
        """The request field errors name."""
        kind = next((k for k in ("json", "regex", "choice", "grammar", "json_object")
                     if getattr(self, k) not in (None, False)), "json")
        return self.source or f"structured_outputs.{kind}"

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a boolean, "
                             f"got {self.disable_any_whitespace!r}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or text), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}")

    def key(self) -> tuple:
        """Hashable identity of the grammar (compiled grammars are cached by it)."""
        schema = json.dumps(self.json, sort_keys=True) if isinstance(self.json, dict) else self.json
        return (schema, self.regex, tuple(self.choice or ()), self.grammar, bool(self.json_object),
                self.disable_any_whitespace)


@dataclass
class SamplingParams:
    """How to sample one request's output tokens (vLLM-compatible fields and defaults).

    temperature 0 means greedy. top_k 0 (or -1) disables top-k; top_p 1 and min_p 0 disable
    theirs. Penalties follow OpenAI (presence/frequency, over output tokens) and vLLM
    (repetition, over prompt and output tokens). max_tokens None means "until max_model_len".
    logprobs / prompt_logprobs = k returns the top-k alternatives plus the chosen token
    (0 = the chosen token only).
    """
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None        # token id -> added to its logit, in [-100, 100]
    # Set by the engine from the model's generation config, not by users.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self):
        self._normalise()
        self._validate()

    def _normalise(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM and some clients send -1 for "no seed"
            self.seed = None
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            setattr(self, name, _as_float(name, getattr(self, name)))
        self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)

    def _validate(self) -> None:
        _check_int("n", self.n, 1)
        # `not (a <= x <= b)` style checks also reject nan.
        if not (0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1)
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_int(name, value, 0)
            if value > MAX_LOGPROBS:
                raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")
        if self.seed is not None:
            if not _is_int(self.seed):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            if not (_SEED_MIN <= self.seed <= _SEED_MAX):
                raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"stop_token_ids must hold integers >= 0, got {token_id!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for {token_id}")
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            if isinstance(self.structured_outputs, dict):
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            else:
                raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {self.structured_outputs!r}")

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below GREEDY_EPS)."""
        return self.temperature < GREEDY_EPS

    @property
    def samples_from_masked_logits(self) -> bool:
        """The next token depends on this step's logits, masked by the request's grammar if it
        has one (and its own generator), but not on the history: no logprobs, penalties or logit
        bias (min_tokens aside, which masks stop tokens for a while). The step's sampling mode
        builds on it (`core/sampling_mode.py`)."""
        return (self.logprobs is None and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and not self.logit_bias)

    def add_eos_token_ids(self, eos_token_ids) -> None:
        """Called by the engine with the model's EOS ids: they stop generation (and are held
        back while min_tokens is unmet) unless ignore_eos is set."""
        if not self.ignore_eos:
            self.all_stop_token_ids.update(eos_token_ids)

    def clone(self) -> SamplingParams:
        """A deep copy, so fanned-out requests never share mutable lists."""
        return copy.deepcopy(self)

    def for_child(self, index: int) -> SamplingParams:
        """The params of the `index`-th of `n` parallel samples: n=1 and, when seeded,
        seed + index so the children differ yet stay reproducible (as vLLM does)."""
        child = self.clone()
        child.n = 1
        if child.seed is not None:
            child.seed = (child.seed + index) % (_SEED_MAX + 1)
        return child
