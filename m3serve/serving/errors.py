"""Errors every API dialect raises: `APIError` carries an HTTP status; `ClientDisconnected`
ends a response nobody reads; `internal_error` is the client's message for a bug of this server.
"""
from __future__ import annotations

import logging
import uuid

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with its HTTP status, turned into the dialect's error body by its router."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


class ClientDisconnected(Exception):
    """The client went away before its non-streaming response was ready."""


def internal_error(e: BaseException) -> str:
    """The client's message for a failure of m3serve itself: generic, with a reference to the
    log line that holds the details (never the exception's text)."""
    ref = uuid.uuid4().hex[:12]
    logger.error("internal error %s: %s: %s", ref, type(e).__name__, e, exc_info=e)
    return f"internal server error (reference {ref} in the server log)"
