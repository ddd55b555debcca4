"""The control channel from a DP replica's leader rank to its TP followers: each step's
`SchedulerOutput` (plus the DP agreement) as msgspec bytes, broadcast over the TP group's
gloo group. No pickle: only the msgspec types below cross.

A message travels as one broadcast of a fixed-size chunk (length prefix + bytes) when it fits,
which every decode step does; a larger one adds a second broadcast of the remainder.
"""
from __future__ import annotations

import json

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from m3serve.core.scheduler_output import SchedulerOutput
from m3serve.worker.model_runner import DPStep

CHUNK_BYTES = 64 << 10


class RunStep(msgspec.Struct, tag="step"):
    scheduler_output: SchedulerOutput
    dp: DPStep | None = None


class Describe(msgspec.Struct, tag="describe"):
    """Every follower answers with its `Worker.describe()` (gathered to the leader)."""


class Stop(msgspec.Struct, tag="stop"):
    pass


ControlMessage = RunStep | Describe | Stop

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlMessage)


class ControlChannel:
    """Leader -> followers broadcast (and followers -> leader gather for reports)."""

    def __init__(self, group, leader_rank: int, group_size: int):
        self.group, self.leader, self.size = group, leader_rank, group_size
        self._chunk = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)
        self._np = self._chunk.numpy()

    def send(self, message) -> None:
        data = _encoder.encode(message)
        n = len(data)
        self._np[:8] = np.frombuffer(n.to_bytes(8, "little"), dtype=np.uint8)
        head = min(n, CHUNK_BYTES - 8)
        self._np[8:8 + head] = np.frombuffer(data, dtype=np.uint8, count=head)
        dist.broadcast(self._chunk, src=self.leader, group=self.group)
        if n > head:
            rest = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)
            dist.broadcast(rest, src=self.leader, group=self.group)

    def recv(self):
        dist.broadcast(self._chunk, src=self.leader, group=self.group)
        n = int.from_bytes(self._np[:8].tobytes(), "little")
        head = min(n, CHUNK_BYTES - 8)
        data = self._np[8:8 + head].tobytes()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            dist.broadcast(rest, src=self.leader, group=self.group)
            data += rest.numpy().tobytes()
        return _decoder.decode(data)

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank of the group passes some bytes; the leader gets them all in TP order
        (None elsewhere). Two collectives: every length to every rank, then the padded payloads."""
        is_leader = dist.get_rank() == self.leader
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.size)]
        dist.all_gather(sizes, size, group=self.group)
        buf = torch.zeros(max(1, max(int(n.item()) for n in sizes)), dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros_like(buf) for _ in range(self.size)] if is_leader else None
        dist.gather(buf, out, dst=self.leader, group=self.group)
        if not is_leader:
            return None
        return [b.numpy()[:int(n.item())].tobytes() for b, n in zip(out, sizes)]

    def gather_reports(self, report: dict) -> list[dict] | None:
        """Every rank of the group passes its report; the leader gets them all in TP order."""
        parts = self.gather_bytes(json.dumps(report).encode())
        return None if parts is None else [json.loads(p) for p in parts]
