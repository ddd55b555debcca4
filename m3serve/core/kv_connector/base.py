"""The KV-connector interface: a scheduler side (one per engine core) and a worker side (one per
rank), the shape of vLLM v1's connectors.

The scheduler side answers, at admission, how many tokens past the GPU prefix hit it can bring
(`get_num_new_matched_tokens`); the scheduler then gives the request blocks for them, parks it
in `RequestStatus.WAITING_FOR_KV` and calls `start_load`. Each step the connector hands the
ranks its work (`build_metadata`, one entry of `SchedulerOutput.kv_connector_metadata`) and
takes back every rank's report (`update`, from `ModelRunnerOutput.kv_connector_output`); loads
that are over come out of `take_finished_loads`, and the scheduler lands them all one way. A
connector that sends KV elsewhere (a P/D producer) may also keep a finished request's blocks
(`request_finished`) until `holds_to_free` lets them go.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass
class ExternalHit:
    """A connector's answer for a request at admission."""

    num_tokens: int
    """Tokens past the GPU prefix hit whose KV the connector brings (0: none; the request is
    admitted as usual and no other connector is asked)."""
    optional: bool = True
    """An optional load (a cache tier's hit) starts only when blocks for the whole prompt are
    free now, and when they are not and nothing will free any, the request is computed without
    it. A required one (a P/D pull) waits for the blocks of what it loads."""
    blocks_come_back: bool = False
    """When an optional load cannot get its blocks: whether copies of this connector in flight
    will free some soon (then the request waits for them)."""


def as_struct(value: Any, struct_type: type):
    """A connector's message as `struct_type`: in-process it is the object itself; across
    processes it arrives as `msgspec.Raw` (the step messages carry each connector's entry
    undecoded) and is decoded here, by the connector that owns its type."""
    if isinstance(value, struct_type):
        return value
    if isinstance(value, msgspec.Raw):
        return msgspec.msgpack.decode(value, type=struct_type)
    return msgspec.convert(value, struct_type)


class KVConnectorScheduler:
    """The scheduler side of one connector. `name` keys its entries in the step messages."""

    name: str = ""
    kv_role: str | None = None
    """Its P/D role ("kv_producer", "kv_consumer", "kv_both"), or None (a tier of this engine's
    own cache, which serves no other engine)."""

    # ------------------------------------------------------------ admission and loads

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int, hit_blocks: list,
                                   count: bool = True) -> ExternalHit | None:
        """What the connector can load for a waiting request whose leading
        `num_computed_tokens` hit the GPU prefix cache (`hit_blocks`). None: nothing of this
        connector's (ask the next one). `count`: the lookup counts in its statistics."""
        return None

    def start_load(self, request, block_ids: list[int], num_computed_tokens: int) -> None:
        """Start loading the answered tokens into the request's blocks `block_ids` (its whole
        list; the first `num_computed_tokens` tokens are the GPU hit)."""
        raise NotImplementedError

    def take_finished_loads(self) -> list[tuple[str, str | None]]:
        """Loads that ended since the last call: (request id, None = done | why it failed).
        Only then may anything reuse the blocks they wrote into."""
        return []

    def on_load_end(self, request, failure: str | None) -> str | None:
        """A load of a live request ended (the scheduler has freed its blocks on a failure).
        Returns an error to finish the request with, or None (it goes on: with the loaded KV,
        or computing its tokens here; a connector that answers for it again at its next
        admission is asked to load it again)."""
        return None

    def abort(self, request_id: str) -> None:
        """A parked request was aborted: stop its load if possible. It still ends through
        `take_finished_loads`."""

    # ------------------------------------------------------------ KV sent elsewhere

    def request_finished(self, request, block_ids: list[int]) -> dict | None:
        """A request finished by length: the params to answer with when its blocks are kept
        for another engine (the scheduler then does not free them), else None."""
        return None

    def holds_to_free(self) -> list[str]:
        """Kept requests whose blocks can go now."""
        return []

    # ------------------------------------------------------------ the ranks

    def build_metadata(self) -> Any | None:
        """This connector's work for the ranks in the step being scheduled (a msgspec struct,
        None = nothing). Every step with work gets a report from every rank."""
        return None

    def update(self, reports: list) -> None:
        """Every rank's report (TP order; each maybe `msgspec.Raw`: see `as_struct`) of a step
        that carried this connector's metadata."""

    def build_step_metadata(self) -> dict[str, Any]:
        """{name: metadata} of the connectors with work this step (what the step carries)."""
        meta = self.build_metadata()
        return {} if meta is None else {self.name: meta}

    def update_step_output(self, output: dict[str, list]) -> None:
        """Apply `ModelRunnerOutput.kv_connector_output` ({name: reports})."""
        if self.name in output:
            self.update(output[self.name])

    # ------------------------------------------------------------ state

    @property
    def has_pending(self) -> bool:
        """Loads, copies or holds exist: the engine loop must keep calling the scheduler."""
        return False

    @property
    def needs_fast_poll(self) -> bool:
        """A load or copy is under way (every wait may be TTFT): the idle engine polls often."""
        return False

    @property
    def has_blocks_in_flight(self) -> bool:
        """GPU blocks it holds come back within a step or two: the scheduler waits for them
        rather than preempting."""
        return False

    def find(self, name: str) -> KVConnectorScheduler | None:
        """The connector called `name` (this one or, in a composite, one of its parts)."""
        return self if name == self.name else None

    def shutdown(self) -> None:
        pass


class KVConnectorWorker:
    """The worker side of one connector, one per rank: `start` before the step's forward with
    the step's metadata for it, `report` after it."""

    name: str = ""

    def start(self, metadata) -> None:
        """Start this step's work (`metadata` maybe `msgspec.Raw`: see `as_struct`)."""
        raise NotImplementedError

    def report(self):
        """This rank's report of the step (a msgspec struct), for the scheduler side's `update`."""
        raise NotImplementedError

    def start_step(self, metadata: dict[str, Any]) -> None:
        if self.name in metadata:
            self.start(metadata[self.name])
        unknown = set(metadata) - {self.name}
        if unknown:
            raise RuntimeError(f"the step carries work for KV connector(s) {sorted(unknown)}, "
                               f"which this rank does not have")

    def step_reports(self, metadata: dict[str, Any]) -> dict[str, Any]:
        return {self.name: self.report()} if self.name in metadata else {}

    def find(self, name: str) -> KVConnectorWorker | None:
        return self if name == self.name else None

    def shutdown(self) -> None:
        pass
