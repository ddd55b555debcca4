"""The errors of an engine client, the same for the server's (`engine/core_client.py`) and the
offline `LLM`'s (`engine/sync_client.py`): a caller handles a refused, failed or dead engine one
way whichever client it holds."""
from __future__ import annotations


class EngineOverloaded(Exception):
    """The engine's waiting queue is at its bound; retry later (HTTP 503)."""


class EngineError(RuntimeError):
    """The engine failed a request (HTTP 500)."""


class RequestFailed(EngineError):
    """The engine ended a request because of what it asked for (HTTP 400, the message says why)."""


class EngineDeadError(EngineError):
    """The engine is not running (it failed to start, failed, or is shut down; the message
    names the rank or replica when one is to blame): HTTP 503."""


class ShuttingDown(EngineDeadError):
    """The server is draining and stopped this request (a 503 for its client)."""
