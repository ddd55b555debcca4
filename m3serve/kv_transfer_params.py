"""`kv_transfer_params` of a request, as vLLM's NIXL connector and the routers send it.

Prefill leg (router -> producer): `{do_remote_decode: true, do_remote_prefill: false, ...}`.
The producer answers with top-level `kv_transfer_params` = `producer_params(...)`, which the
router copies verbatim (unknown keys included) into the decode leg, where `do_remote_prefill`
asks the consumer to pull the prompt's KV instead of computing it. Unknown keys are ignored;
keys of the wrong type are an error naming the key. Torch-free (the API process uses it).
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any

import msgspec


class KVTransferParams(msgspec.Struct, omit_defaults=True):
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_block_ids: list[int] | None = None
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int | None = None
    prompt_hash: str | None = None   # the producer's prompt; a decode leg with another prompt is refused

    @property
    def remote_address(self) -> str:
        return f"tcp://{self.remote_host}:{self.remote_port}"


_REMOTE_KEYS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def _check(value, ok: bool, key: str, expected: str) -> None:
    if not ok:
        shown = repr(value)
        raise ValueError(f"kv_transfer_params.{key} must be {expected}, got "
                         f"{shown if len(shown) <= 80 else shown[:77] + '...'}")


def parse_kv_transfer_params(raw: Any) -> KVTransferParams | None:
    """The request field -> `KVTransferParams` (None when absent or null). ValueError names the
    bad key; a decode leg (`do_remote_prefill`) must carry every remote_* key."""
    if raw is None:
        return None
    _check(raw, isinstance(raw, dict), "", "a JSON object")
    values = {}
    for key in ("do_remote_decode", "do_remote_prefill"):
        v = raw.get(key)
        _check(v, v is None or isinstance(v, bool), key, "true, false or null")
        values[key] = bool(v)
    if values["do_remote_decode"] and values["do_remote_prefill"]:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true")
    if values["do_remote_prefill"]:
        missing = [k for k in _REMOTE_KEYS if raw.get(k) is None]
        if missing:
            raise ValueError(f"kv_transfer_params: do_remote_prefill needs {', '.join(missing)} "
                             f"(copy the prefill response's kv_transfer_params unchanged)")
        ids = raw["remote_block_ids"]
        _check(ids, isinstance(ids, list) and len(ids) > 0 and all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids),
            "remote_block_ids", "a non-empty list of block ids (integers >= 0)")
        for key in ("remote_engine_id", "remote_request_id", "remote_host"):
            v = raw[key]
            _check(v, isinstance(v, str) and 0 < len(v) <= 512, key, "a non-empty string")
        port = raw["remote_port"]
        _check(port, isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536,
               "remote_port", "a port number in [1, 65535]")
        tp = raw.get("tp_size")
        _check(tp, tp is None or (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1),
               "tp_size", "a positive integer")
        h = raw.get("prompt_hash")
        _check(h, h is None or (isinstance(h, str) and len(h) <= 128), "prompt_hash", "a string")
        values.update({k: raw[k] for k in _REMOTE_KEYS}, tp_size=tp, prompt_hash=h)
    return KVTransferParams(**values)


def prompt_hash(token_ids: list[int]) -> str:
    """A digest of a prompt's token ids: producer and consumer must hold the same prompt."""
    data = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def producer_params(block_ids: list[int], engine_id: str, request_id: str, host: str, port: int,
                    tp_size: int, token_ids: list[int]) -> dict:
    """What a producer returns (top level of its response) for the decode leg."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(block_ids),
            "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host,
            "remote_port": port, "tp_size": tp_size, "prompt_hash": prompt_hash(token_ids)}
