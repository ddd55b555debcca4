"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal whole
prefixes. The cache salt (per-tenant isolation) is mixed into the first block only; every later
block inherits it through the chain. A block that holds placeholder tokens of an image or video
also covers the content hashes of those items: the same text with another image never shares a
block, the same image does.
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Sequence


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _encode_parent(parent_hash: int | bytes | None) -> bytes:
    # Distinct tags keep None, an int seed and a bytes hash from ever serializing alike.
    if parent_hash is None:
        return b"N"
    if isinstance(parent_hash, bytes):
        return b"B" + _length_prefixed(parent_hash)
    if isinstance(parent_hash, int):
        return b"I" + _length_prefixed(str(parent_hash).encode())
    raise TypeError(f"parent_hash must be int, bytes or None, got {type(parent_hash).__name__}")


def hash_block(parent_hash: int | bytes | None, token_ids: tuple[int, ...],
               extra: str | None = None) -> bytes:
    """sha256 over (parent hash, token ids, extra); returns the 32-byte digest."""
    h = hashlib.sha256()
    h.update(_encode_parent(parent_hash))
    h.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(b"N" if extra is None else b"S" + _length_prefixed(extra.encode("utf-8")))
    return h.digest()


def _block_extra(b: int, block_size: int, cache_salt: str | None,
                 mm_spans: Sequence[tuple[int, int, str]]) -> str | None:
    salt = cache_salt if b == 0 else None
    start, end = b * block_size, (b + 1) * block_size
    media = [h for s, e, h in mm_spans if s < end and e > start]
    if not media:
        return salt
    return json.dumps([salt, media])


def request_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                         known_hashes: Sequence[bytes] = (),
                         mm_spans: Sequence[tuple[int, int, str]] = ()) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` that come after the `known_hashes` prefix.

    Incremental: pass the hashes computed so far and only the newly full blocks are hashed;
    the caller appends the result. A trailing partial block is never hashed. `mm_spans`:
    (start, end, content hash) of each image / video's placeholder tokens.
    """
    num_full_blocks = len(token_ids) // block_size
    parent = known_hashes[-1] if known_hashes else None
    new_hashes = []
    for b in range(len(known_hashes), num_full_blocks):
        block_tokens = tuple(token_ids[b * block_size:(b + 1) * block_size])
        parent = hash_block(parent, block_tokens, _block_extra(b, block_size, cache_salt, mm_spans))
        new_hashes.append(parent)
    return new_hashes
