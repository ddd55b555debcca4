"""The agentic multi-turn workload of `m3serve bench serve --dataset-name agentic|agentic-trace`.

Owns the session plan (sessions of turns: new user/tool tokens, output budget, think time), its
two sources (a seeded synthetic generator shaped like InferenceX AgentX traffic, and JSONL
traces: ours or InferenceX's Weka corpus lines), and the conversation that turns a session's
turns plus the model's actual replies into each turn's request. No network here: the runner is
`m3serve.bench.agentic_serve`. Statistics and sources: docs/benchmarks.md section 8.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from m3serve.bench.datasets import SampleRequest, TokenizerView, build_prompt

# AgentX compresses recorded idle gaps to 10 s (aiperf `--trace-idle-gap-cap-seconds 10`).
AGENTX_THINK_TIME_CAP_S = 10.0


@dataclass(frozen=True)
class TurnSpec:
    """One turn of a session as planned before any reply exists.

    `new_tokens` is the length of the user/tool text this turn appends (or `text` itself when a
    trace gives it); `output_len` is the turn's max_tokens; `think_time_s` is the pause between
    the previous reply's end and this turn's send (end-to-start, as AgentX replays); `reset`
    drops the conversation so far (a trace whose context was rewritten, e.g. compacted).
    """

    new_tokens: int
    output_len: int
    think_time_s: float = 0.0
    reset: bool = False
    text: str | None = None


@dataclass(frozen=True)
class SessionSpec:
    session_id: str
    turns: tuple[TurnSpec, ...]


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of the synthetic generator (defaults and their sources: docs/benchmarks.md §8).

    Lengths other than the first turn's are lognormal: `median * exp(sigma * N(0, 1))`, rounded,
    clamped to [1, max]. Think times are lognormal too, capped at `max_think_time_s`.
    """

    num_sessions: int = 16
    num_turns: int = 8
    min_turns: int | None = None         # None = every session has num_turns; else uniform [min, num]
    first_input_len: int = 8192          # system prompt + tool schemas + first user message
    new_tokens_median: float = 500.0
    new_tokens_sigma: float = 1.4
    output_len_median: float = 300.0
    output_len_sigma: float = 1.0
    think_time_median_s: float = 2.0
    think_time_sigma: float = 1.0
    max_think_time_s: float = AGENTX_THINK_TIME_CAP_S
    max_new_tokens: int = 16384
    max_output_len: int = 4096

    def validate(self) -> None:
        for name in ("num_sessions", "num_turns", "first_input_len", "max_new_tokens", "max_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"agentic {name} must be >= 1, got {getattr(self, name)}")
        if self.min_turns is not None and not 1 <= self.min_turns <= self.num_turns:
            raise ValueError(f"agentic min_turns must be in [1, num_turns={self.num_turns}], "
                             f"got {self.min_turns}")
        for name in ("new_tokens_median", "output_len_median"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"agentic {name} must be >= 1, got {getattr(self, name)}")
        for name in ("new_tokens_sigma", "output_len_sigma", "think_time_sigma",
                     "think_time_median_s", "max_think_time_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"agentic {name} must be a finite number >= 0, got {value}")


def _lognormal_ints(rng: np.random.Generator, median: float, sigma: float, size: int,
                    upper: int) -> np.ndarray:
    values = np.rint(median * np.exp(sigma * rng.standard_normal(size)))
    return np.clip(values, 1, upper).astype(np.int64)   # [size]


def generate_sessions(config: SyntheticConfig, seed: int = 0) -> list[SessionSpec]:
    """The synthetic session plan: the same config and seed always give the same plan.

    Turn 0 appends `first_input_len` tokens (system + tools + first request); every later turn
    appends a lognormal number of user/tool tokens after the model's previous reply.
    """
    config.validate()
    rng = np.random.default_rng([seed, 31])
    sessions = []
    for s in range(config.num_sessions):
        low = config.min_turns or config.num_turns
        num_turns = int(rng.integers(low, config.num_turns + 1))
        new = _lognormal_ints(rng, config.new_tokens_median, config.new_tokens_sigma, num_turns,
                              config.max_new_tokens)
        new[0] = config.first_input_len
        out = _lognormal_ints(rng, config.output_len_median, config.output_len_sigma, num_turns,
                              config.max_output_len)
        think = np.minimum(config.think_time_median_s
                           * np.exp(config.think_time_sigma * rng.standard_normal(num_turns)),
                           config.max_think_time_s)
        think[0] = 0.0
        turns = tuple(TurnSpec(int(n), int(o), float(t)) for n, o, t in zip(new, out, think))
        sessions.append(SessionSpec(f"session-{s}", turns))
    return sessions


# ---- JSONL traces --------------------------------------------------------------------------

class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _think_time(value, what: str, cap_s: float) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a number of seconds >= 0, got {value!r}")
    return min(float(value), cap_s)


def _session_from_ours(obj: dict, index: int, cap_s: float) -> SessionSpec:
    turns_in = obj.get("turns")
    if not isinstance(turns_in, list) or not turns_in:
        raise ValueError("'turns' must be a non-empty list")
    turns = []
    for k, turn in enumerate(turns_in):
        where = f"turn {k}"
        if not isinstance(turn, dict):
            raise ValueError(f"{where} must be an object, got {type(turn).__name__}")
        unknown = set(turn) - {"new_tokens", "text", "output_tokens", "think_time_s", "reset"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
        text = turn.get("text")
        if text is not None and (not isinstance(text, str) or not text):
            raise ValueError(f"{where}: text must be a non-empty string")
        if text is None and "new_tokens" not in turn:
            raise ValueError(f"{where}: needs new_tokens or text")
        new = _positive_int(turn["new_tokens"], f"{where}: new_tokens") if "new_tokens" in turn else 0
        if "output_tokens" not in turn:
            raise ValueError(f"{where}: needs output_tokens")
        out = _positive_int(turn["output_tokens"], f"{where}: output_tokens")
        reset = turn.get("reset", False)
        if not isinstance(reset, bool):
            raise ValueError(f"{where}: reset must be true or false, got {reset!r}")
        think = _think_time(turn.get("think_time_s"), f"{where}: think_time_s", cap_s)
        turns.append(TurnSpec(new, out, 0.0 if k == 0 else think, reset, text))
    session_id = obj.get("session_id", f"session-{index}")
    return SessionSpec(str(session_id), tuple(turns))


def _turns_from_weka(requests: list, block: int, cap_s: float, where: str) -> list[TurnSpec]:
    """Weka requests (InferenceX AgentX corpus) -> turns. A request's new tokens are its input
    minus the previous request's input and output (the conversation it extends); a request that
    does not extend the previous one (its hash_ids share less than the previous input, or without
    hash_ids its input shrank) starts over from its whole input."""
    turns: list[TurnSpec] = []
    prev = None
    for k, req in enumerate(requests):
        w = f"{where}request {k}"
        if not isinstance(req, dict):
            raise ValueError(f"{w} must be an object")
        n_in = _positive_int(req.get("in"), f"{w}: in")
        n_out = _positive_int(req.get("out"), f"{w}: out")
        hashes = req.get("hash_ids")
        reset = False
        if prev is None:
            new = n_in
        else:
            p_in, p_out, p_hashes = prev
            if isinstance(hashes, list) and isinstance(p_hashes, list) and p_hashes:
                shared = 0
                for a, b in zip(hashes, p_hashes):
                    if a != b:
                        break
                    shared += 1
                reset = shared * block < p_in - block
            else:
                reset = n_in < p_in
            new = n_in if reset else max(n_in - p_in - p_out, 1)
        think = _think_time(req.get("think_time"), f"{w}: think_time", cap_s)
        turns.append(TurnSpec(new, n_out, 0.0 if k == 0 else think, reset))
        prev = (n_in, n_out, hashes)
    return turns


def _sessions_from_weka(obj: dict, index: int, cap_s: float) -> list[SessionSpec]:
    trace_id = str(obj.get("id", f"trace-{index}"))
    requests = obj.get("requests")
    if not isinstance(requests, list) or not requests:
        raise ValueError("'requests' must be a non-empty list")
    # hash_ids stand for block_size tokens each (64 in the published corpora)
    block = _positive_int(obj.get("block_size", 64), "block_size")
    main, subagents = [], []
    for k, req in enumerate(requests):
        if isinstance(req, dict) and req.get("type") == "subagent":
            subagents.append((k, req))
        else:
            main.append(req)
    sessions = []
    if main:
        sessions.append(SessionSpec(trace_id, tuple(_turns_from_weka(main, block, cap_s, ""))))
    for k, sub in subagents:
        inner = sub.get("requests")
        if not isinstance(inner, list) or not inner:
            raise ValueError(f"request {k} (subagent): 'requests' must be a non-empty list")
        sub_id = f"{trace_id}/{sub.get('agent_id', k)}"
        sessions.append(SessionSpec(sub_id, tuple(
            _turns_from_weka(inner, block, cap_s, f"request {k} (subagent) inner "))))
    return sessions


def load_trace(path: str | os.PathLike, max_think_time_s: float = AGENTX_THINK_TIME_CAP_S,
               max_sessions: int | None = None, max_turns: int | None = None) -> list[SessionSpec]:
    """Sessions from a JSONL trace: one object per line, either ours (`{"session_id", "turns":
    [{"new_tokens" | "text", "output_tokens", "think_time_s", "reset"}]}`) or an InferenceX
    AgentX / Weka trace (`{"id", "block_size", "requests": [{"in", "out", "hash_ids",
    "think_time"} | {"type": "subagent", "requests": [...]}]}`); a Weka subagent becomes a
    session of its own. Blank lines are skipped. Raises TraceError naming the line on bad input.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path!r}: {exc}") from exc
    sessions: list[SessionSpec] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        try:
            if not isinstance(obj, dict):
                raise ValueError(f"must be a JSON object, got {type(obj).__name__}")
            if "turns" in obj:
                found = [_session_from_ours(obj, len(sessions), max_think_time_s)]
            elif "requests" in obj:
                found = _sessions_from_weka(obj, len(sessions), max_think_time_s)
            else:
                raise ValueError("needs 'turns' (m3serve session) or 'requests' "
                                 "(InferenceX/Weka trace)")
        except ValueError as exc:
            raise TraceError(f"{where}: {exc}") from None
        sessions.extend(found)
    if not sessions:
        raise TraceError(f"{path}: no sessions in the trace")
    if max_turns is not None:
        sessions = [SessionSpec(s.session_id, s.turns[:max_turns]) for s in sessions]
    return sessions[:max_sessions] if max_sessions is not None else sessions


# ---- the conversation ----------------------------------------------------------------------

def turn_texts(tokenizer, sessions: list[SessionSpec], seed: int = 0) -> list[list[str]]:
    """The user/tool text of every turn: the trace's own text, else random tokens of the turn's
    length (from a TokenizerView or any tokenizer it can wrap). Seeded per session, so a
    session's texts do not depend on the others'; every session's first text differs, so
    sessions never share a cached prefix (AgentX's cache-busting does the same per session)."""
    view = tokenizer if isinstance(tokenizer, TokenizerView) else TokenizerView(tokenizer)
    texts = []
    for s, session in enumerate(sessions):
        rng = np.random.default_rng([seed, 32, s])
        texts.append([t.text if t.text is not None else build_prompt(view, t.new_tokens, rng)[0]
                      for t in session.turns])
    return texts


@dataclass
class Conversation:
    """A session's conversation as the client re-sends it each turn.

    Chat: alternating user (user/tool text) and assistant (the model's actual reply) messages.
    Completions: the same segments concatenated into one prompt. Either way turn k+1's request
    is turn k's request + turn k's reply + the new text: a prefix extension, so that a server's
    prefix cache can serve everything but the new tail.
    """

    endpoint_type: str = "completions"
    segments: list[tuple[str, str]] = field(default_factory=list)   # (role, text)

    def reset(self) -> None:
        self.segments.clear()

    def add_user(self, text: str) -> None:
        self.segments.append(("user", text))

    def add_reply(self, text: str) -> None:
        self.segments.append(("assistant", text))

    def prompt(self) -> str:
        return "".join(text for _, text in self.segments)

    def messages(self) -> list[dict]:
        return [{"role": role, "content": text} for role, text in self.segments]

    def request(self, output_len: int, prompt_len: int = 0) -> SampleRequest:
        """This turn's request (max_tokens = output_len)."""
        if self.endpoint_type == "chat":
            return SampleRequest("", prompt_len, output_len, messages=self.messages())
        return SampleRequest(self.prompt(), prompt_len, output_len)
