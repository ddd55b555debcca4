"""The data that crosses between the scheduler and the worker, and back out of the engine core.

`SchedulerOutput` is the only thing the worker learns about a step; it is a diff against the
worker's persistent per-request state. `ModelRunnerOutput` is what the worker returns, and
`EngineCoreOutput` (the protocol's `CoreOutput`) is what the core emits per request after
applying it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from m3serve.core.sampling_mode import SamplingMode
from m3serve.protocol import CoreOutput, MultiModalInput
from m3serve.sampling_params import SamplingParams


@dataclass
class DraftBlocks:
    """A window draft's block-table diff for one request (DSpark keeps its KV in a pool of its
    own, `core/kv_cache/draft_window.py`; its table is indexed by logical block like the
    target's, entries not held are 0, the null block)."""

    first_block: int
    """Logical blocks below this one are no longer held: their entries become 0."""
    new_block_ids: list[int]
    """Draft blocks appended after the last one held (at `first_block` when none is held)."""
    valid_from: int
    """Positions below this hold no draft KV of the request's prefix (holes); its draft
    queries never read below it."""


@dataclass
class NewRequestData:
    """A request the worker has never seen (first admission)."""

    req_id: str
    prompt_token_ids: list[int]
    """The full prompt. The worker keeps it as the start of the request's token list."""
    sampling_params: SamplingParams
    """Passed through untouched; the worker's sampler interprets it."""
    block_ids: list[int]
    """The request's whole block list (shared by every cache group): block_ids[b] holds logical
    positions [b*block_size, (b+1)*block_size). Includes prefix-hit blocks."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache before this step: a prefix hit (a multiple of
    block_size) or KV pulled from a prefill worker (any count). This step computes positions
    [num_computed_tokens, + num_scheduled_tokens)."""
    mm_inputs: list[MultiModalInput] = field(default_factory=list)
    """protocol.MultiModalInput per image / video of the prompt. Pixels come only with the
    items whose encoder output the request does not hold yet (the others' `pixel_values` are
    empty: their output is in the rank's encoder-output store); the worker encodes such an item
    the first time a step computes one of its placeholder positions, unless the store has it by
    then, and drops its pixels once it has the output."""
    draft_blocks: DraftBlocks | None = None
    """With a window draft: the request's draft blocks (None: it holds none)."""


@dataclass
class CachedRequestData:
    """Requests the worker already knows, as parallel lists indexed like `req_ids`."""

    req_ids: list[str]
    resumed_from_preemption: list[bool]
    """True if the request was preempted earlier and is scheduled again. The worker kept its
    token list but dropped its block table: `new_block_ids` then REPLACES the block list, and its
    KV is recomputed from `num_computed_tokens` (a prefix-hit count, usually 0)."""
    new_token_ids: list[list[int]]
    """Tokens appended to the request since the worker last heard of it (the sampled tokens the
    scheduler accepted). The worker appends them to its token list; together with the prompt this
    is always the request's full token list as the scheduler sees it."""
    new_block_ids: list[list[int] | None]
    """Blocks to append to the request's block list this step (None or [] = none), or the full
    replacement list when resumed_from_preemption is True."""
    num_computed_tokens: list[int]
    """Tokens with KV in the cache before this step; this step computes
    [num_computed_tokens, + num_scheduled_tokens) of the token list (+ draft tokens)."""
    draft_blocks: list[DraftBlocks | None] = field(default_factory=list)
    """With a window draft: each request's draft-table diff (applied after a resumed request's
    table is cleared); empty without one."""

    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        return cls([], [], [], [], [], [])

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class KVOffloadWork(msgspec.Struct):
    """The CPU tier connector's step metadata ("cpu_tier").
    Copies between the GPU block pool and the CPU tier that every rank makes this step, each
    of its own shard, on a side stream (in this order: the stores, then the loads). A message
    with any copy is one batch; batches complete in the order they were sent."""
    store_block_ids: list[int] = []
    """GPU blocks to copy out (every cache group) ..."""
    store_slots: list[int] = []
    """... into these CPU slots (same length)."""
    load_slots: list[int] = []
    """CPU slots to copy back ..."""
    load_block_ids: list[int] = []
    """... into these GPU blocks (same length)."""
    poll: bool = False
    """Batches are in flight: report how many have completed on every rank."""

    @property
    def has_copies(self) -> bool:
        return bool(self.store_block_ids or self.load_slots)


class KVOffloadReport(msgspec.Struct):
    """The CPU tier connector's report: batches completed since start (on one rank; over all
    of them, the smallest count), and the time spent copying each way (seconds, since start;
    the driver rank's counts)."""
    num_batches_done: int = 0
    seconds_to_cpu: float = 0.0
    seconds_to_gpu: float = 0.0


@dataclass
class SchedulerOutput:
    """One engine step: which requests run, how many tokens each, and what changed."""

    scheduled_new_reqs: list[NewRequestData]
    """Requests scheduled for the first time."""
    scheduled_cached_reqs: CachedRequestData
    """Requests the worker knows: continuing (decode or the next prefill chunk) or resumed."""
    num_scheduled_tokens: dict[str, int]
    """req_id -> tokens computed this step (including draft tokens), for every scheduled request.
    A request whose computed count stays below its token count after this step is a partial
    prefill chunk: the worker still returns a sampled token for it, which the scheduler discards."""
    total_num_scheduled_tokens: int
    """Sum of num_scheduled_tokens; at most max_num_batched_tokens."""
    scheduled_spec_decode_tokens: dict[str, list[int]]
    """req_id -> draft tokens to verify this step (they are the last tokens scheduled for that
    request); absent for requests without drafts."""
    finished_req_ids: set[str]
    """Requests that finished or were aborted since the previous step; the worker drops all state
    of them. Their blocks are already free."""
    preempted_req_ids: set[str]
    """Requests preempted in this step; the worker removes them from its batch and forgets their
    block ids, but keeps their tokens for a later resume."""
    kv_connector_metadata: dict[str, msgspec.Raw] | None = None
    """KV connectors' work for the ranks this step, by connector name (`core/kv_connector`):
    each value is that connector's own msgspec struct (P/D pulls to start, CPU-tier copies, ...;
    across processes it arrives as `msgspec.Raw`, decoded by the connector). Every rank reports
    on each connector named here. None = no connector has work."""
    sampling_modes: dict[str, SamplingMode] = field(default_factory=dict)
    """req_id -> how its next token is drawn (`core/sampling_mode.py`), for every scheduled
    request: decided here once per step; the worker samples by it and never re-derives it."""
    speculate: bool = True
    """With a draft model: whether this step runs the draft pass, verifying the drafts in
    `scheduled_spec_decode_tokens` (the first j of each request's k, the same j for every
    decode: `core/spec_gate.py`; none in a switch step, the first after plain steps) and
    proposing the next ones (False: a plain decode step, by disable_by_batch_size or measured
    speed)."""
    propose: bool = True
    """With `speculate`: whether the draft pass proposes drafts (False: it only writes the step's
    tokens into the draft's KV -- a step that computes prompt tokens in a bucket whose arm is
    plain steps, where the next plain step would drop any proposal; eager steps honour it)."""
    deferred: bool = False
    """Async scheduling: the step's sampled tokens stay on the device (the next step's inputs
    take them from there) and its output comes with the next call (`ModelRunnerOutput.previous`).
    Only for steps whose every request is ARGMAX (or LOGITS, on one rank) and wants no prompt
    logprobs."""
    sampled_req_ids: list[str] = field(default_factory=list)
    """Deferred steps: the requests whose context is complete after the step (their sampled token
    is real; the others are partial prefill chunks)."""
    encoder_cache_frees: list[str] = field(default_factory=list)
    """Encoder outputs (`multimodal.inputs.encoder_key`) every rank drops from its store before
    this step runs: the scheduler's encoder cache evicted them (`core/encoder_cache.py`)."""

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass
class ModelRunnerOutput:
    """What the worker returns for one step, one entry per scheduled request."""

    req_ids: list[str]
    """The scheduled requests, in the worker's batch order."""
    sampled_token_ids: list[list[int]]
    """Per request: the sampled token (one), or with drafts the accepted drafts plus the bonus
    token (1..num_drafts+1). Reported for partial prefill chunks too; the scheduler drops those."""
    logprobs: list | None = None
    """Per request, opaque to the scheduler and passed through to the EngineCoreOutput."""
    prompt_logprobs: dict[str, object] = field(default_factory=dict)
    """req_id -> prompt logprobs of this step's chunk; opaque, passed through."""
    spec_token_ids: list[list[int]] | None = None
    """Per request, the draft tokens proposed for its next step ([] = none); None when the
    engine does not speculate."""
    kv_connector_output: dict[str, list] | None = None
    """For a step with `kv_connector_metadata`: by connector name, every rank's report (TP
    order; each the connector's own struct, or `msgspec.Raw` from another process)."""
    previous: "ModelRunnerOutput | None" = None
    """Async scheduling: the output of the previous step when that step was deferred."""
    failed: dict[str, str] = field(default_factory=dict)
    """req_id -> why the request cannot go on, by what it asked for (its sampled token is void):
    the scheduler finishes it with that client error and the step's other requests go on."""


# One request's news after a step (tokens accepted and, if it ended, why): the protocol's record,
# emitted by the scheduler and sent as it is from the engine process.
EngineCoreOutput = CoreOutput
