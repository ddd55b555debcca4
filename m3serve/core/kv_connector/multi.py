"""Several connectors as one (vLLM's MultiConnector idea): the scheduler and the ranks see one
connector; admission asks the parts in order and the first that answers owns the request's load.
"""
from __future__ import annotations

from typing import Any

from m3serve.core.kv_connector.base import KVConnectorScheduler, KVConnectorWorker


class MultiConnectorScheduler(KVConnectorScheduler):
    name = "multi"

    def __init__(self, parts: list[KVConnectorScheduler]):
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"KV connectors need distinct names, got {names}")
        self.parts = list(parts)
        self.kv_role = next((p.kv_role for p in parts if p.kv_role is not None), None)
        self._owner: dict[str, KVConnectorScheduler] = {}     # request id -> connector loading it
        self._answered: tuple[str, KVConnectorScheduler] | None = None
        self._ended: dict[str, KVConnectorScheduler] = {}     # ... of loads just taken as over

    def get_num_new_matched_tokens(self, request, num_computed_tokens, hit_blocks, count=True):
        for part in self.parts:
            hit = part.get_num_new_matched_tokens(request, num_computed_tokens, hit_blocks, count)
            if hit is not None:
                self._answered = (request.request_id, part)
                return hit
        return None

    def start_load(self, request, block_ids, num_computed_tokens):
        rid, part = self._answered
        if rid != request.request_id:
            raise RuntimeError(f"start_load of {request.request_id!r}, but the last lookup was {rid!r}")
        self._owner[rid] = part
        part.start_load(request, block_ids, num_computed_tokens)

    def take_finished_loads(self):
        out = []
        for part in self.parts:
            out += part.take_finished_loads()
        self._ended = {rid: self._owner.pop(rid) for rid, _ in out}
        return out

    def on_load_end(self, request, failure):
        # for a load just taken as over (`take_finished_loads`)
        return self._ended.pop(request.request_id).on_load_end(request, failure)

    def abort(self, request_id):
        part = self._owner.get(request_id)
        if part is not None:
            part.abort(request_id)

    def request_finished(self, request, block_ids):
        for part in self.parts:
            params = part.request_finished(request, block_ids)
            if params is not None:
                return params
        return None

    def holds_to_free(self):
        out = []
        for part in self.parts:
            out += part.holds_to_free()
        return out

    def build_step_metadata(self) -> dict[str, Any]:
        out = {}
        for part in self.parts:
            out.update(part.build_step_metadata())
        return out

    def update_step_output(self, output: dict[str, list]) -> None:
        for part in self.parts:
            part.update_step_output(output)

    @property
    def has_pending(self):
        return any(p.has_pending for p in self.parts)

    @property
    def needs_fast_poll(self):
        return any(p.needs_fast_poll for p in self.parts)

    @property
    def has_blocks_in_flight(self):
        return any(p.has_blocks_in_flight for p in self.parts)

    def find(self, name):
        return next((p for p in self.parts if p.name == name), None)

    def shutdown(self):
        for part in self.parts:
            part.shutdown()


class MultiConnectorWorker(KVConnectorWorker):
    name = "multi"

    def __init__(self, parts: list[KVConnectorWorker]):
        self.parts = {p.name: p for p in parts}

    def start_step(self, metadata: dict[str, Any]) -> None:
        unknown = set(metadata) - set(self.parts)
        if unknown:
            raise RuntimeError(f"the step carries work for KV connector(s) {sorted(unknown)}, "
                               f"which this rank does not have")
        for name, part in self.parts.items():      # in the order they were configured
            if name in metadata:
                part.start(metadata[name])

    def step_reports(self, metadata: dict[str, Any]) -> dict[str, Any]:
        return {name: part.report() for name, part in self.parts.items() if name in metadata}

    def find(self, name):
        return self.parts.get(name)

    def shutdown(self):
        for part in self.parts.values():
            part.shutdown()


def combine(parts: list, multi: type):
    """None, the one connector, or a composite of several."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else multi(parts)
