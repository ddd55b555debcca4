"""Helpers of the P/D tests: flags, prompts long enough that sparse block selection matters,
greedy references without near-ties, the two-leg protocol as the routers run it, and the leak
check through /metrics."""
import json
import random
import time
import uuid

import httpx

KEY = "pd-secret"
HEADERS = {"Authorization": f"Bearer {KEY}"}
# The tiny model's sparse layers keep 4 blocks of 16 tokens: prompts of several hundred tokens
# make the index cache decide what decode attends to.
SPARSE_SPAN = 4 * 16


def kv_flags(role: str, **extra) -> tuple[str, str]:
    return ("--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                "kv_connector_extra_config": extra}))


def pd_flags(role: str, **extra) -> tuple[str, ...]:
    """A P/D server of the tiny model behind the API key, in float32 (see F32_MARGIN)."""
    return ("--api-key", KEY, "--dtype", "float32", *kv_flags(role, **extra))


def long_prompt(seed: int, words: int = 110) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "kernel", "block", "sparse", "index", "cache", "token", "router", "decode",
             "prefill", "river", "stone", "cloud", "paper", "signal", "vector", "matrix", "orbit"]
    return " ".join(rng.choice(vocab) + str(rng.randrange(50)) for _ in range(words))


def completion_body(seed: int, max_tokens: int = 12, **kw) -> dict:
    return {"model": "tiny", "prompt": long_prompt(seed), "max_tokens": max_tokens, "temperature": 0, **kw}


def chat_body(seed: int, max_tokens: int = 12, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": long_prompt(seed)}],
            "max_tokens": max_tokens, "temperature": 0, **kw}


# The tiny random model's logits tie or nearly tie often (in bf16 about 3 % of greedy steps tie
# exactly, a fifth are within 4 ulps), so two computations of one prompt that round anything
# differently can pick different tokens at such a step and diverge from there. A test comparing
# greedy text across computations uses prompts whose every greedy step leads its runner-up by a
# margin (in logits, = logprobs) that rounding cannot cross, and checks it on the reference, so
# a tie can neither fail the test by chance nor let a real difference pass as one. TP layouts
# round differently. Batching does not on CPU: projections and attention round once from fp64,
# and so do the router's and SwiGLU's sigmoids (torch's fp32 sigmoid gives an element one ulp
# apart in its vector loop and in its scalar tail; before they were fp64, an ulp in a routing
# weight moved a later logprob by up to 0.05, tests/model/test_engine.py checks the whole
# path bit for bit). The compared computations are still batched alike where a test can
# arrange it, each alone on an idle server (wait_steps_idle), so a mismatch points at the path.
# The logits are not the only choices: the sparse layers pick 4 of a long prompt's blocks and
# the MoE layers 2 of 8 experts by score, and those scores near-tie too, below anything the
# logit margin sees (in bf16 on seed 95's 12 greedy steps: 1.6e-4 relative between the 4th and
# 5th block, 2.8e-5 between the 2nd and 3rd expert). A bf16 ulp is 4e-3 of a value, so one
# rounding difference in such a score flips a choice and the text with it; a bf16 stalled-pull
# test failed that way once. The P/D servers therefore run in float32, whose ulp (6e-8) is
# 65,536 times finer.
F32_MARGIN = 0.01        # float32 servers: TP 1 and TP 2 logprobs differ by < 3e-6 here
_TOP = 5


def greedy_gaps(route: str, response_json: dict) -> list[float]:
    """Per output token: its logprob minus the best other token's (from a response that asked
    for top-5 logprobs). The completions format keys alternatives by text, merging tokens that
    decode to one string (keeping the best logprob); only a chosen token whose text is not
    its own bytes' (a partial character, U+FFFD, or an empty special token) can hide the
    runner-up that way, so where such a token's list lost entries the position counts as 0:
    its runner-up is unknown."""
    choice = response_json["choices"][0]
    gaps = []
    if route.endswith("/chat/completions"):
        for pos in choice["logprobs"]["content"]:
            top = pos["top_logprobs"]
            assert top[0]["logprob"] == pos["logprob"], pos     # greedy picked the best token
            gaps.append(top[0]["logprob"] - top[1]["logprob"])
        return gaps
    lp = choice["logprobs"]
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert chosen == max(top.values()), top
        others = [v for t, v in top.items() if t != token]
        known = len(top) == _TOP or (token and "\ufffd" not in token)      # nothing merged, or not into it
        gaps.append(chosen - max(others) if known else 0.0)
    return gaps


def _greedy_with_logprobs(server, route: str, body: dict) -> dict:
    assert body.get("temperature") == 0, body
    extra = {"logprobs": True, "top_logprobs": _TOP} if route.endswith("/chat/completions") else {"logprobs": _TOP}
    r = post(server, route, {**body, **extra, "stream": False})
    assert r.status_code == 200, r.text
    return r.json()


def wait_steps_idle(server, timeout_s: float = 20.0) -> None:
    """Nothing runs or waits on `server` (KV it holds for a consumer computes nothing), so one
    request sent now runs alone: its prompt in one step, each decode step a batch of one."""
    deadline = time.time() + timeout_s
    while True:
        m = server.metrics()
        if not m.get("m3serve:num_requests_running", 0) and not m.get("m3serve:num_requests_waiting", 0):
            return
        assert time.time() < deadline, f"{server.url} is still computing: {m}"
        time.sleep(0.1)


def greedy_reference(server, route: str, body: dict, margin: float = F32_MARGIN) -> str:
    """The server's greedy text for `body`, computed alone (the server idle first, as the
    compared consumer request is), after checking that no step of it is a near-tie (see
    F32_MARGIN); a prompt that has one is the test's mistake: pick another seed."""
    wait_steps_idle(server)
    out = _greedy_with_logprobs(server, route, body)
    gaps = greedy_gaps(route, out)
    near = [(i, g) for i, g in enumerate(gaps) if g < margin]
    assert not near, f"the reference has near-ties (step, logit gap) {near} below {margin}: choose another prompt"
    return text_of(out)


def _top2(route: str, response_json: dict) -> list:
    """Per output token: its top-2 (token, logprob)."""
    choice = response_json["choices"][0]
    if route.endswith("/chat/completions"):
        return [[(t["token"], round(t["logprob"], 4)) for t in pos["top_logprobs"][:2]]
                for pos in choice["logprobs"]["content"]]
    return [sorted(((t, round(v, 4)) for t, v in top.items()), key=lambda kv: -kv[1])[:2]
            for top in choice["logprobs"]["top_logprobs"]]


def assert_same_greedy(got: str, want: str, producer, consumer, route: str, body: dict) -> None:
    """`got` (the consumer's text for `body`) equals `want` (the producer's greedy_reference).
    On a mismatch, before failing, each server computes the prompt once more on its own (alone,
    a fresh cache salt: no prefix hit), and the message says which computation differs, with
    every step's top-2 logprobs of both: the consumer's request path (its pulled or recomputed
    KV), the consumer's process as a whole, or the producer."""
    if got == want:
        return
    salted = {**body, "cache_salt": uuid.uuid4().hex}
    wait_steps_idle(consumer)
    local = _greedy_with_logprobs(consumer, route, salted)
    again = None
    if producer is not None:           # None: the producer is gone
        wait_steps_idle(producer)
        again = _greedy_with_logprobs(producer, route, {**body, "cache_salt": uuid.uuid4().hex})
    if again is not None and text_of(again) != want:
        verdict = "the producer does not reproduce its own reference"
    elif text_of(local) == want:
        verdict = "the consumer computes the prompt as the producer does; its request path (pulled or recomputed KV) does not"
    elif text_of(local) == got:
        verdict = "the consumer's process computes this prompt differently from the producer's (whatever the path)"
    else:
        verdict = "the consumer computes differently on each try"
    raise AssertionError(f"{verdict}\n  consumer's answer {got!r}\n  producer's reference {want!r}\n"
                         f"  consumer alone {text_of(local)!r}\n"
                         f"  producer again {text_of(again) if again else None!r}\n"
                         f"  consumer alone, top-2 per step {_top2(route, local)}\n"
                         f"  producer again, top-2 per step {_top2(route, again) if again else None}")


def post(server, route: str, body: dict, headers=HEADERS, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers=headers, timeout=timeout)


def prefill_leg(p, route: str, body: dict) -> dict:
    """What vllm-router sends to the producer; returns its JSON (with kv_transfer_params)."""
    leg = {**body, "max_tokens": 1, "min_tokens": 1, "stream": False,
           "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    leg.pop("stream_options", None)
    r = post(p, route, leg)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["kv_transfer_params"]["do_remote_prefill"] is True, out
    return out


def decode_leg(d, route: str, body: dict, params: dict, **kw) -> httpx.Response:
    return post(d, route, {**body, "kv_transfer_params": params}, **kw)


def text_of(response_json: dict) -> str:
    choice = response_json["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def sse_text(response: httpx.Response) -> str:
    """Concatenated text of an SSE stream (completions or chat)."""
    out = []
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        for choice in event.get("choices", []):
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def metrics(server) -> dict[str, float]:
    return server.metrics()


def assert_clean(server, timeout_s: float = 20.0) -> dict:
    """No running sequence, no KV block held, nothing held for or pulled from another worker."""
    deadline = time.time() + timeout_s
    while True:
        m = server.metrics()
        busy = {k: m.get(k, 0) for k in ("m3serve:num_requests_running", "m3serve:num_requests_waiting",
                                          "m3serve:kv_cache_usage_perc", "m3serve:kv_transfer_held_blocks",
                                          "m3serve:kv_transfer_active_pulls")}
        if not any(busy.values()):
            return m
        assert time.time() < deadline, f"{server.url} still holds work: {busy}"
        time.sleep(0.2)


class RouterProc:
    """`m3serve route ...` (which becomes the router) on a free port, ready once a completion
    goes through it."""

    def __init__(self, log_path, *route_args: str):
        import os
        import subprocess
        import sys

        from serverutil import REPO_ROOT, free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "m3serve", "route", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-port", str(free_port()), *route_args]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + 90
        while True:
            try:
                r = httpx.post(self.url + "/v1/completions", headers=HEADERS, timeout=30,
                               json={"model": "tiny", "prompt": "warm up", "max_tokens": 2, "temperature": 0})
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"router did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
