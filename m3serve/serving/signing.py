"""Reasoning text that travels through a client and back: signed blobs.

Clients that keep the conversation themselves send the model's earlier reasoning back on the next
turn, sometimes only as an opaque token: Responses' `encrypted_content` (with `store: false`) and
the Messages API's thinking `signature` (with `thinking.display: "omitted"` the thinking text is
not sent to the client at all). A blob holds the text and an HMAC-SHA256 over it with a server
key: it is signed, not encrypted (its text is readable), and a changed blob, or one signed with
another key, is refused. Servers given the same key (--responses-signing-key) read each other's.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os


class ReasoningSigner:
    """Reasoning text <-> signed blob."""

    PREFIX = "m3r1."

    def __init__(self, key: str | bytes | None = None):
        if isinstance(key, str):
            key = key.encode("utf-8")
        self._key = hashlib.sha256(key).digest() if key else os.urandom(32)

    def _mac(self, body: str) -> str:
        digest = hmac.new(self._key, body.encode("ascii"), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")

    def sign(self, text: str) -> str:
        payload = base64.urlsafe_b64encode(json.dumps({"text": text}, ensure_ascii=False).encode("utf-8"))
        body = self.PREFIX + payload.decode("ascii").rstrip("=")
        return f"{body}.{self._mac(body)}"

    def open(self, blob: str) -> str | None:
        """The text of a blob this server (or one sharing its key) issued; None for any other
        string (altered, truncated, signed with another key, or not a blob at all)."""
        body, _, mac = blob.rpartition(".")
        if not body.startswith(self.PREFIX) or not body.isascii() or not mac.isascii() or \
                not hmac.compare_digest(self._mac(body), mac):
            return None
        payload = body[len(self.PREFIX):]
        try:
            text = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["text"]
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None
        return text if isinstance(text, str) else None
