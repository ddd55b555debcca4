"""Messages between the API process and the engine-core process (msgspec, msgpack on ZMQ).

The API process (or the offline `LLM`) sends `AddRequests`, `AbortRequests`, `StatsQuery`,
`StateQuery` and `Shutdown` to each engine process (one per DP replica); every engine answers
with one `EngineReady` (or `EngineDead`) at start-up, then `CoreOutputs` batches, `EngineState`
reports, and `EngineDead` if it fails later. Only plain data crosses: token ids, sampling
parameters, counters. Never pickled engine objects.
"""
from __future__ import annotations

from typing import Any

import msgspec

from m3serve.kv_transfer_params import KVTransferParams
from m3serve.sampling_params import SamplingParams


class MultiModalInput(msgspec.Struct):
    """One preprocessed image or video of a request (`multimodal/processor.py`): its patches as
    raw float32 bytes ([num_patches, 1176], the vision tower's order), the (t, h, w) grid of each
    attention segment, the placeholder tokens it fills, and a content hash (prefix-cache key)."""

    modality: str                       # "image" | "video"
    pixel_values: bytes
    num_patches: int
    grids: list[tuple[int, int, int]]
    num_tokens: int
    content_hash: str


class EngineCoreRequest(msgspec.Struct):
    """One sequence for the scheduler (n > 1 is fanned out into children by the API process)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    cache_salt: str | None = None
    kv_transfer_params: KVTransferParams | None = None   # P/D: prefill for, or pull from, another worker
    mm_inputs: list[MultiModalInput] | None = None       # images / videos, in prompt order per modality


class AddRequests(msgspec.Struct, tag="add"):
    """The children of one user request, admitted together or not at all.

    The engine answers with an `AddResult` keyed by `parent_id` before any of their outputs.
    """

    parent_id: str
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class StatsQuery(msgspec.Struct, tag="stats"):
    query_id: int


class StateQuery(msgspec.Struct, tag="state"):
    """Asks for an `EngineState` (answered after the engine's next step)."""
    query_id: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInput = AddRequests | AbortRequests | StatsQuery | StateQuery | Shutdown


class CoreOutput(msgspec.Struct):
    """One sequence's news after an engine step: tokens accepted and, if it ended, why. The
    scheduler makes it (`core.scheduler_output.EngineCoreOutput` is this class) and the engine
    process sends it as it is."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while it continues
    stop_reason: int | str | None = None  # the stop token id that ended it (None for EOS or length)
    # per position: [token id, logprob, rank, top ids, top logprobs]
    new_logprobs: list[Any] | None = None
    new_prompt_logprobs: list[Any] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    error: str | None = None  # set with finish_reason "error": the engine failed this request
    error_is_client: bool = False  # ... because of what the request asked (a 400), not a bug
    kv_transfer_params: dict | None = None  # P/D: the finished prefill's KV is held for a decode worker

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class AddResult(msgspec.Struct):
    """Admission verdict for one `AddRequests`. `kind`: "ok" | "invalid" (a 400) | "overloaded"
    (the waiting queue is at its bound: a 503) | "error" (an engine bug: a 500)."""

    parent_id: str
    kind: str
    message: str | None = None


# Upper bounds of the per-step token histogram (`m3serve:iteration_tokens_total`, vLLM's buckets)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineStats(msgspec.Struct):
    """Engine-side gauges and counters, sampled after a step (or on a `StatsQuery`)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_usable_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up since start
    prefix_cache_hits: int = 0     # tokens found since start
    num_preemptions: int = 0
    num_steps: int = 0
    num_step_errors: int = 0
    # tokens computed per step, over the steps that computed any: counts per bucket of
    # ITERATION_TOKEN_BUCKETS (not cumulative; one more for larger steps) and their sum
    iteration_token_counts: list[int] = []
    iteration_tokens_sum: int = 0
    # speculative decoding (zeros when off); synthetic acceptance is a benchmarking mode
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    spec_synthetic_acceptance: bool = False
    # KV transfer (P/D); zeros without --kv-transfer-config
    kv_held_requests: int = 0        # finished prefills whose KV waits for a decode worker
    kv_held_blocks: int = 0
    kv_holds_released: int = 0       # ... freed after their decode worker pulled (or gave up)
    kv_holds_expired: int = 0        # ... freed by the hold timeout
    kv_pulls_active: int = 0         # requests pulling their prompt's KV
    kv_pulls_done: int = 0
    kv_pulls_failed: int = 0
    kv_fallbacks: int = 0            # failed pulls recomputed here
    kv_bytes_transferred: int = 0
    kv_num_descriptors: int = 0
    kv_xfer_seconds_sum: float = 0.0
    kv_xfer_count: int = 0
    # CPU tier (--kv-offloading-size); zeros without it. Queries count the prompt tokens of every
    # request looked up in the tier (vLLM's external prefix cache), hits the tokens loaded back.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_bytes_to_cpu: int = 0
    kv_offload_bytes_to_gpu: int = 0
    kv_offload_seconds_to_cpu: float = 0.0
    kv_offload_seconds_to_gpu: float = 0.0
    kv_offload_evictions: int = 0
    kv_offload_usage: float = 0.0     # fraction of the tier's slots holding a block
    kv_offload_num_slots: int = 0
    # encoder-output cache (--mm-encoder-cache-gb; core/encoder_cache.py): images and videos a
    # step had to compute, those whose output was held already (the rest were encoded), outputs
    # evicted, and the bytes of outputs held on each rank (running requests' included)
    mm_encoder_cache_queries: int = 0
    mm_encoder_cache_hits: int = 0
    mm_encoder_cache_evictions: int = 0
    mm_encoder_cache_bytes: int = 0


class CoreOutputs(msgspec.Struct, tag="outputs"):
    """Everything the engine has to say since its last message."""

    outputs: list[CoreOutput] = []
    add_results: list[AddResult] = []
    stats: EngineStats | None = None
    query_id: int | None = None  # set when this message answers a StatsQuery
    dp_rank: int = 0


class EngineState(msgspec.Struct, tag="state"):
    """One DP replica's books, for checks: queues, free blocks, the scheduler's integrity check,
    and a report of every rank of the replica (`Worker.describe()` plus rank and world size)."""

    query_id: int
    dp_rank: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_usable_blocks: int
    integrity_error: str | None
    ranks: list[dict[str, Any]]
    num_preemptions: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_hits: int = 0   # prompt tokens loaded back from the CPU tier
    num_offload_refs: int = 0             # GPU blocks and CPU slots held by copies in flight
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    num_deferred_steps: int = 0      # async scheduling: steps whose tokens stayed on the device
    traced_bytes: int = 0            # M3SERVE_DEBUG_TRACEMALLOC: Python bytes held (memtrace)


class EngineReady(msgspec.Struct, tag="ready"):
    """Sent once the model is loaded and the engine loop runs."""

    max_model_len: int
    block_size: int
    num_usable_blocks: int
    vocab_size: int
    eos_token_id: int | None
    dp_rank: int = 0
    world_size: int = 1
    max_waiting_requests: int = 0     # the waiting queue's bound (--max-waiting-requests); 0 = none told
    media_refusal: str = ""           # why images and videos are refused ("": accepted)


class EngineDead(msgspec.Struct, tag="dead"):
    """Sent when the engine process cannot start or stops on a fatal error."""

    message: str
    dp_rank: int = 0


EngineOutput = CoreOutputs | EngineState | EngineReady | EngineDead

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(EngineInput)
_output_decoder = msgspec.msgpack.Decoder(EngineOutput)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_input(data: bytes):
    return _input_decoder.decode(data)


def decode_output(data: bytes):
    return _output_decoder.decode(data)
