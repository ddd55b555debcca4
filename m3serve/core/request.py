"""One generation sequence as the engine core sees it: its tokens, progress and status.

A `Request` is one sequence (n > 1 is fanned out above the scheduler). The scheduler moves it
between statuses and advances `num_computed_tokens`; the KV manager fills `block_hashes`.
"""
from __future__ import annotations

import enum
from typing import Any


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every value from FINISHED_STOPPED on is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_KV = 3          # holds its blocks while a KV connector loads into them (a P/D
                                # pull, a copy back from the CPU tier, ...)
    WAITING_FOR_GRAMMAR = 4     # no blocks; its structured-outputs grammar is being compiled
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence: prompt, generated tokens, and how much of it has KV in the cache.

    `sampling_params` is duck-typed; the scheduler reads `.max_tokens`, `.min_tokens`,
    `.stop_token_ids` and `.ignore_eos` (and `.prompt_logprobs` if present, to skip prefix hits).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        eos_token_id: int | None,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
        kv_transfer_params: Any = None,
        mm_inputs: list | None = None,
        mm_spans: list[tuple[int, int, str]] | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt
        # kv_transfer_params.KVTransferParams: prefill for a decode worker, or pull the prompt's KV
        self.kv_transfer_params = kv_transfer_params
        # tokens of its last admission whose KV a KV connector loaded (past its GPU prefix
        # hit; 0 = none), and whether any load of it was required (a P/D pull: its blocks are
        # never given up to make room, unlike those of an optional load such as the CPU tier's)
        self.num_external_tokens = 0
        self.kv_load_required = False
        # its prefix lookup is counted in the hit-rate counters (once per admission, not per
        # step it waits at the head of the queue)
        self.lookup_counted = False
        # protocol.MultiModalInput per image / video; their pixels go to the worker with the
        # request's first admission and are dropped here then (the worker keeps those it may
        # still encode); the (start, end, content hash) of each one's placeholder tokens
        # (prefix-cache keys), and each one's key in the encoder cache (`mm_keys`, set with
        # the spans)
        self.mm_inputs = list(mm_inputs or [])
        self.mm_spans = list(mm_spans or [])
        self.mm_keys: list[str] = []
        # indices of mm_inputs whose encoder output the request holds in the encoder cache
        # (core/encoder_cache.py), from the step that first needs it (or its first admission,
        # when the output is there already) until it finishes, preemption included
        self.mm_held: set[int] = set()

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)  # prompt + output
        # Tokens whose KV is in the cache (or is being written by the step just scheduled).
        self.num_computed_tokens = 0
        # Draft tokens to verify in the next step; they extend the sequence only once accepted.
        self.spec_token_ids: list[int] = []
        # Chained hashes of the full blocks of `all_token_ids`, filled lazily by the KV manager.
        self.block_hashes: list[bytes] = []
        # Prefix-cache hit (tokens) at first admission; reported to the client as cached tokens.
        self.num_cached_tokens = 0
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Async scheduling: tokens sampled by steps still running, not yet appended (0 or 1).
        self.num_output_placeholders = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "abort" once finished, else None."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
