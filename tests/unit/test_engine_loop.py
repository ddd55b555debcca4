"""The engine-process loop on the tiny model, in-process: a step that raises fails only its
requests (blocks freed, the loop keeps serving), bad requests are refused without side effects,
and the waiting queue's bound answers "overloaded". Messages survive a msgpack round trip."""
import pytest

from m3serve import protocol
from m3serve.config import EngineConfig
from m3serve.engine.engine_core import EngineCore
from m3serve.engine.engine_proc import EngineLoop
from m3serve.protocol import AddRequests, EngineCoreRequest
from m3serve.sampling_params import SamplingParams
from m3serve.executor.uniproc import UniProcExecutor


@pytest.fixture(scope="module")
def loop(tiny_dir):
    config = EngineConfig.from_kwargs(model=str(tiny_dir), max_waiting_requests=3, max_num_seqs=2)
    return EngineLoop(EngineCore(config, UniProcExecutor(config, tiny_dir, progress=False)))


def _add(parent: str, num_children: int = 1, prompt=(5, 6, 7, 8), max_tokens: int = 3) -> AddRequests:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    message = AddRequests(parent, [EngineCoreRequest(f"{parent}-{i}", list(prompt), params.clone(), None, 0.0)
                                   for i in range(num_children)])
    return protocol.decode_input(protocol.encode(message))  # what the engine process really gets


def _run(loop: EngineLoop) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    finished = {}
    while loop.has_work():
        for out in loop.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
    return tokens, finished


def _check_clean(loop: EngineLoop) -> None:
    stats = loop.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    loop.core.kv_manager.check_integrity()
    loop.core.scheduler.check_integrity()


def test_step_exception_fails_only_its_requests(loop, monkeypatch):
    assert loop.add(_add("a", 2)).kind == "ok"
    real = loop.core.executor.execute_model
    calls = []

    def broken(scheduler_output):
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(loop.core.executor, "execute_model", broken)
    outputs = loop.step()
    assert sorted(o.request_id for o in outputs) == ["a-0", "a-1"]
    assert all(o.finish_reason == "error" and "boom" in o.error for o in outputs)
    assert loop.stats().num_step_errors == 1
    _check_clean(loop)
    monkeypatch.setattr(loop.core.executor, "execute_model", real)
    assert loop.add(_add("b")).kind == "ok"
    tokens, finished = _run(loop)
    assert finished == {"b-0": "length"} and len(tokens["b-0"]) == 3
    _check_clean(loop)


def test_invalid_request_is_refused_atomically(loop):
    result = loop.add(_add("long", 2, prompt=[1] * (loop.core.max_model_len + 1)))
    assert result.kind == "invalid" and "max_model_len" in result.message
    duplicate = AddRequests("dup", [_add("d").requests[0], _add("d").requests[0]])
    result = loop.add(duplicate)
    assert result.kind == "invalid" and "already" in result.message
    _check_clean(loop)  # the first child of "dup" was taken back


def test_waiting_bound_answers_overloaded(loop):
    assert loop.add(_add("w", 2)).kind == "ok"
    result = loop.add(_add("x", 2))  # 2 waiting + 2 > bound 3
    assert result.kind == "overloaded" and "--max-waiting-requests" in result.message
    assert loop.add(_add("y", 1)).kind == "ok"
    _, finished = _run(loop)
    assert sorted(finished) == ["w-0", "w-1", "y-0"]
    _check_clean(loop)


def test_abort_frees_blocks(loop):
    assert loop.add(_add("z", 1, max_tokens=50)).kind == "ok"
    loop.step()
    assert loop.stats().kv_cache_usage > 0
    loop.abort(["z-0"])
    loop.step()  # reports the abort to the worker
    _check_clean(loop)
