"""Every message of KV transfer that crosses a process, as msgspec structs (never pickle).

Side channel (consumer -> producer, ZMQ REQ/ROUTER): `Claim` (is this request's KV still held
here, for this prompt and these blocks? optionally with the engine's `EngineMetadata`) and
`Release` (the consumer is done with it), both answered by a `Reply`.

Scheduler -> worker ranks (inside the `SchedulerOutput`): `KVConnectorMetadata`.
Worker ranks -> scheduler (gathered from every rank of the replica): `RankResult`.
"""
from __future__ import annotations

import msgspec


class Region(msgspec.Struct, array_like=True):
    """One cache plane of one layer on one rank, as registered with the transport.

    Block b of the plane starts at `base + b * block_stride`; token t of it at
    `+ t * token_stride`; within a token the rank's `num_heads` heads of `head_bytes` each,
    global heads [head_start, head_start + num_heads) of `total_heads` (the index cache: 1 of 1).
    """
    name: str            # "<layer>.k" | "<layer>.v" | "<layer>.index"
    base: int
    block_stride: int
    token_stride: int
    head_bytes: int
    head_start: int
    num_heads: int
    total_heads: int


class RankMetadata(msgspec.Struct):
    tp_rank: int
    agent_name: str
    agent_metadata: bytes
    mem_type: str        # "DRAM" | "VRAM"
    device_id: int
    regions: list[Region]


class EngineMetadata(msgspec.Struct):
    """A producer engine as a consumer needs it: its ranks' agents and cache layouts."""
    engine_id: str
    tp_size: int
    block_size: int
    num_blocks: int
    ranks: list[RankMetadata]


class Claim(msgspec.Struct, tag="claim"):
    """Is `request_id`'s KV held here, in exactly `block_ids`, for this prompt? A yes also
    extends the hold (the consumer is about to pull it)."""
    engine_id: str
    request_id: str
    block_ids: list[int]
    prompt_hash: str | None = None
    want_metadata: bool = False


class Release(msgspec.Struct, tag="release"):
    """The consumer has finished with these requests' KV (pulled it, or gave up): free it."""
    engine_id: str
    request_ids: list[str]


class Reply(msgspec.Struct, tag="reply"):
    ok: bool
    error: str | None = None
    metadata: EngineMetadata | None = None


SideMessage = Claim | Release | Reply


class RecvJob(msgspec.Struct, array_like=True):
    """Pull `remote_block_ids` of producer `engine_id` into `local_block_ids` (same length)."""
    request_id: str
    engine_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]


class KVConnectorMetadata(msgspec.Struct):
    """What the worker ranks do for KV transfer this step."""
    remote_engines: list[EngineMetadata] = []   # producers the ranks have not met yet
    recv: list[RecvJob] = []                     # pulls to start
    poll: bool = False                           # pulls are in flight: every rank reports


class RankResult(msgspec.Struct):
    """One rank's pulls that ended since its last report."""
    done: list[str] = []
    failed: dict[str, str] = {}                  # request id -> reason
    num_bytes: int = 0
    num_descriptors: int = 0
    xfer_seconds: list[float] = []               # one per finished pull


_encoder = msgspec.msgpack.Encoder()
_side_decoder = msgspec.msgpack.Decoder(SideMessage)
_rank_result_decoder = msgspec.msgpack.Decoder(RankResult)
_rank_metadata_decoder = msgspec.msgpack.Decoder(RankMetadata)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_side(data: bytes):
    return _side_decoder.decode(data)


def decode_rank_result(data: bytes) -> RankResult:
    return _rank_result_decoder.decode(data)


def decode_rank_metadata(data: bytes) -> RankMetadata:
    return _rank_metadata_decoder.decode(data)
