"""Grammars are compiled off the engine loop (structured.compiler.GrammarCompiles): a request
waits for its grammar in its own state while the loop steps the others; a grammar past its time
bound, too large, or invalid fails only its request; the compiler is warm before the first
constrained request arrives. The tiny model, in-process."""
import threading
import time

import pytest

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar")

from m3serve import protocol  # noqa: E402
from m3serve.config import EngineConfig  # noqa: E402
from m3serve.engine.engine_core import EngineCore  # noqa: E402
from m3serve.engine.engine_proc import EngineLoop  # noqa: E402
from m3serve.core.request import RequestStatus  # noqa: E402
from m3serve.executor.uniproc import UniProcExecutor  # noqa: E402
from m3serve.protocol import AddRequests, EngineCoreRequest  # noqa: E402
from m3serve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from m3serve.structured.tool_grammar import tool_call_grammar  # noqa: E402
from m3serve.structured import compiler as structured  # noqa: E402

SLOW = 'root ::= "slow"'          # compiled by the stand-in below in SLOW_S seconds
SLOW_S = 6.0     # the other requests, a forced-tool grammar among them, finish well inside it (2 busy cores)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def make_loop(tiny_dir):
    loops = []

    def make(**flags):
        config = EngineConfig.from_kwargs(model=str(tiny_dir), max_num_seqs=4, **flags)
        loops.append(EngineLoop(EngineCore(config, UniProcExecutor(config, tiny_dir, progress=False))))
        return loops[-1]
    yield make
    for loop in loops:
        loop.core.shutdown()


@pytest.fixture()
def slow_compiles(monkeypatch):
    """The grammar SLOW takes SLOW_S seconds to compile (a sleep: no CPU spent); others compile."""
    real = structured.compile_grammar
    calls = []

    def compile_grammar(params, tokenizer_dir, vocab_size):
        calls.append(params.structured_outputs.grammar)
        if params.structured_outputs.grammar == SLOW:
            time.sleep(SLOW_S)
        return real(params, tokenizer_dir, vocab_size)
    monkeypatch.setattr(structured, "compile_grammar", compile_grammar)
    return calls


def _add(loop, rid: str, grammar: str | None = None, max_tokens: int = 3, n: int = 1):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(grammar=grammar) if grammar else None)
    params.add_eos_token_ids([loop.core.geometry.model_config.eos_token_id])
    ids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
    message = AddRequests(rid, [EngineCoreRequest(i, [5, 6, 7, 8], params.clone(), None, 0.0) for i in ids])
    return loop.add(protocol.decode_input(protocol.encode(message)))


def _run_until(loop, done, timeout_s: float):
    """Step the loop until `done(finished)` holds; returns {request id: (finish, error, seconds)}."""
    finished, start = {}, time.monotonic()
    while not done(finished):
        assert time.monotonic() - start < timeout_s, f"still running after {timeout_s} s: {finished}"
        for out in loop.step():
            if out.finished:
                finished[out.request_id] = (out.finish_reason, out.error, time.monotonic() - start)
    return finished


def _check_clean(loop):
    stats = loop.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    loop.core.scheduler.check_integrity()
    assert not structured._READY


def test_a_slow_grammar_delays_only_its_own_request(make_loop, slow_compiles):
    """While one grammar compiles for SLOW_S seconds, a forced-tool request and a plain one are
    admitted, compiled and run to the end; the slow one runs once its grammar is ready."""
    loop = make_loop()
    forced = tool_call_grammar([TOOL], "required", "disabled")
    start = time.monotonic()
    assert _add(loop, "slow", SLOW).kind == "ok"
    assert time.monotonic() - start < 1.0                   # admission did not wait for the compile
    assert loop.core.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert _add(loop, "tool", forced, max_tokens=2).kind == "ok"
    assert _add(loop, "plain").kind == "ok"
    finished = _run_until(loop, lambda f: {"tool", "plain"} <= set(f), timeout_s=30)
    assert finished["tool"][:2] == ("length", None) and finished["plain"][:2] == ("length", None)
    assert "slow" not in finished                               # still compiling
    assert loop.core.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
    finished = _run_until(loop, lambda f: "slow" in f, timeout_s=30)
    assert finished["slow"][1] is None and time.monotonic() - start >= SLOW_S
    _check_clean(loop)


def test_a_grammar_past_its_time_bound_fails_only_its_request(make_loop, slow_compiles):
    loop = make_loop(grammar_compile_timeout_seconds=0.5)
    assert _add(loop, "slow", SLOW).kind == "ok"
    assert _add(loop, "plain").kind == "ok"
    finished = _run_until(loop, lambda f: {"slow", "plain"} <= set(f), timeout_s=SLOW_S)
    reason, error, seconds = finished["slow"]
    assert reason == "error" and "did not compile within 0.5 s" in error and seconds < SLOW_S
    assert finished["plain"][:2] == ("length", None)
    _check_clean(loop)


def test_too_large_invalid_and_aborted_grammars_fail_alone(make_loop):
    loop = make_loop()
    huge = "root ::= " + " ".join(f'"t{i}"' for i in range(structured.MAX_GRAMMAR_CHARS // 8))
    assert _add(loop, "huge", huge).kind == "ok"
    assert _add(loop, "bad", 'root ::= "a" | ').kind == "ok"
    assert _add(loop, "gone", 'root ::= "b"').kind == "ok"
    loop.abort(["gone"])
    assert _add(loop, "plain").kind == "ok"
    finished = _run_until(loop, lambda f: {"huge", "bad", "plain"} <= set(f), timeout_s=60)
    assert finished["huge"][0] == "error" and "too large to compile" in finished["huge"][1]
    assert finished["bad"][0] == "error" and "structured_outputs.grammar is not valid" in finished["bad"][1]
    assert finished["plain"][:2] == ("length", None) and "gone" not in finished
    _check_clean(loop)


def test_the_compiler_is_warm_before_the_first_request(make_loop):
    """Start-up compiles a tool-call grammar: the xgrammar import and the compiler over the
    vocabulary (the seconds a first forced call used to pay inside the engine loop) are done."""
    structured._compiler.cache_clear()
    structured._CACHE.clear()
    loop = make_loop()
    loop.core.grammars.warm.result(timeout=120)
    eos = loop.core.geometry.model_config.eos_token_id
    misses = structured._compiler.cache_info().misses
    params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(
        grammar=tool_call_grammar([TOOL], "required", None)))
    params.add_eos_token_ids([eos])
    structured.compile_grammar(params, loop.core.geometry.model_dir, loop.core.geometry.model_config.vocab_size)
    assert structured._compiler.cache_info().misses == misses      # the warm compiler served it


def test_the_children_of_one_request_share_one_compilation(make_loop, slow_compiles):
    loop = make_loop()
    assert _add(loop, "n", SLOW, n=3).kind == "ok"
    finished = _run_until(loop, lambda f: len(f) == 3, timeout_s=30)
    assert [f[1] for f in finished.values()] == [None] * 3
    assert slow_compiles.count(SLOW) == 1
    _check_clean(loop)



def test_choice_matches_its_text_exactly_with_spaces_newlines_and_metacharacters():
    import xgrammar as xgr
    text = 'a b\n"x"\t]<]m[>[<f>/tmp/x.txt</f> {1} $5 ^ - \\ (end)?'
    grammar = structured.parse_constraint(StructuredOutputsParams(choice=[text, "other"]))
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab)).compile_grammar(grammar)
    for candidate, accepted in ((text, True), ("other", True), (text.replace("\n", "n"), False),
                                (text.replace(" ", ""), False), (text[:-1], False)):
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        whole = all(matcher.accept_string(ch) for ch in candidate) and matcher.is_completed()
        assert whole == accepted, (candidate, accepted)
