"""The API process's generation front: tokens in, `RequestState` updates out.

`ServingEngine` owns the tokenizer and the one thread that tokenizes off the event loop,
prompt-length limits, the fan-out of n > 1 into engine
requests, incremental detokenization and stop strings (through `RequestState`), the abort of a
request whose consumer went away, and the latency/token metrics. The chat turn and the
completions endpoint build on it.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from tokenizers import Tokenizer

from m3serve import envs
from m3serve.engine.errors import EngineError, RequestFailed
from m3serve.sampling_params import SamplingParams
from m3serve.serving.metrics import ServerMetrics
from m3serve.serving.output_processor import RequestState
from m3serve.serving.steer import Steering, load_rules


class ServingEngine:
    """Shared by the endpoints: validates prompts against the engine's limits and streams
    `RequestState`s of submitted requests (the same object, updated in place)."""

    def __init__(self, client, tokenizer: Tokenizer, metrics: ServerMetrics, sampling_defaults: dict | None = None):
        self.client = client
        self.sampling_defaults = dict(sampling_defaults or {})   # the generation config's values
        self.steering = Steering(load_rules(envs.TEST_STEER)) if envs.TEST_STEER else None
        self.tokenizer = tokenizer
        self.metrics = metrics
        info = client.info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.eos_token_id = info.eos_token_id
        # The scheduler needs KV for every token but the last: total tokens <= capacity + 1.
        self.max_total_tokens = min(info.max_model_len, info.num_usable_blocks * info.block_size + 1)
        self.block_size = info.block_size
        self.max_waiting = info.max_waiting_requests
        # No token covers more characters than its own string has: a text longer than this
        # (twice over, for normalizers) cannot fit, and is refused before it is tokenized.
        longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
        self.max_prompt_chars = 2 * longest * self.max_total_tokens
        # Tokenization and chat templates run off the event loop on this one thread, never on
        # asyncio's default pool: the tokenizer holds the GIL while it encodes (more threads buy
        # no parallelism), and its native code keeps memory per thread that calls it, which
        # grew the process by ~350 bytes per request as a pool of threads took turns.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="m3serve-tokenizer")

    async def off_loop(self, fn, *args):
        """`fn(*args)` on the tokenizer thread (tokenizing, rendering a chat template)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                                 functools.partial(fn, *args))

    def close(self) -> None:
        """Stop the tokenizer thread (calls still queued are cancelled)."""
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (call it off the event loop: long texts take a while)."""
        if len(text) > self.max_prompt_chars:
            raise ValueError(f"prompt is too long: {len(text)} characters cannot fit in this model's "
                             f"maximum context length of {self.max_total_tokens} tokens")
        # encode_batch lets go of the GIL while it works (encode holds it: a 1M-character
        # prompt would stall the event loop, and every other request, for seconds)
        [encoding] = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        """ValueError when prompts x n sequences could never wait in the engine's queue at once."""
        if self.max_waiting and num_prompts * n > self.max_waiting:
            raise ValueError(f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences exceed the "
                             f"waiting queue's bound (--max-waiting-requests {self.max_waiting})")

    def check_token_ids(self, ids: list[int], field: str = "prompt") -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field} contains token id {bad}, outside the vocabulary [0, {self.vocab_size})")

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None,
                           field: str = "max_tokens") -> int | None:
        """The request's max_tokens within the context (None -> fill the context); ValueError
        when the prompt, or the prompt plus max_tokens, does not fit (naming `field`, the
        request's name of max_tokens)."""
        limit = self.max_total_tokens
        if num_prompt_tokens == 0:
            raise ValueError("prompt is empty: it must hold at least one token")
        if num_prompt_tokens + 1 > limit:
            raise ValueError(
                f"prompt is too long: {num_prompt_tokens} tokens, but this model's maximum context "
                f"length is {limit} tokens (max_model_len {self.max_model_len}) and at least one "
                f"token must be generated")
        if max_tokens is None:
            return min(limit - num_prompt_tokens, self.sampling_defaults.get("max_tokens", limit))
        if isinstance(max_tokens, int) and max_tokens > 0 and num_prompt_tokens + max_tokens > limit:
            raise ValueError(
                f"{field} is too large: {max_tokens} + {num_prompt_tokens} prompt tokens exceed "
                f"this model's maximum context length of {limit} tokens")
        return max_tokens

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, arrival_time: float, cache_salt: str | None = None,
                       kv_transfer_params=None, mm_inputs=None) -> AsyncIterator[RequestState]:
        """Submit one request (n children); yield its state once admitted (no tokens yet),
        then after every batch of engine outputs until all children finish. Raises ValueError /
        EngineOverloaded / EngineError before the first yield when the engine refuses it.
        Closing the generator early (a client disconnect, a cancelled task) aborts the
        unfinished children in the engine, which frees their blocks."""
        if params.logit_bias:
            self.check_token_ids(list(params.logit_bias), "logit_bias")
        if self.steering is not None:
            params = self.steering.apply(prompt if prompt is not None else self.tokenizer.decode(prompt_token_ids,
                                                                                               skip_special_tokens=False),
                                         params)
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer)
        requests = state.engine_requests(self.eos_token_id, cache_salt, kv_transfer_params, mm_inputs)
        queue = await self.client.add_requests(request_id, requests)
        del requests, mm_inputs          # the engine has the pixels: none stay here for the request's life
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        by_id = {seq.request_id: seq for seq in state.sequences}
        last_output: dict[str, float] = {}
        try:
            yield state
            while not state.finished:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                now = time.perf_counter()
                for out in batch:
                    if isinstance(out, Exception):
                        raise out
                    if out.error is not None:
                        raise (RequestFailed if out.error_is_client else EngineError)(out.error)
                    seq = by_id[out.request_id]
                    if seq.finished:
                        continue
                    if out.new_token_ids:
                        self._record_tokens(out.request_id, len(out.new_token_ids), now,
                                            arrival_time, last_output)
                    if seq.update(out):
                        self.client.abort([seq.request_id])  # a stop string ended it
                    if seq.finished:
                        self.metrics.finished(seq.finish_reason)
                yield state
            self.metrics.e2e.observe(time.perf_counter() - arrival_time)
        finally:
            unfinished = [s for s in state.sequences if not s.finished]
            if unfinished:
                self.client.abort([s.request_id for s in unfinished])
                for _ in unfinished:
                    self.metrics.finished("abort")

    def _record_tokens(self, seq_id: str, num_tokens: int, now: float, arrival_time: float,
                       last_output: dict[str, float]) -> None:
        self.metrics.generation_tokens.inc(num_tokens)
        previous = last_output.get(seq_id)
        if previous is None:
            if not last_output:
                self.metrics.ttft.observe(now - arrival_time)
        else:
            self.metrics.itl.observe(now - previous)
        last_output[seq_id] = now
