"""What the routers share on the app (`app.state.server`): the engine client, the server's
config and metrics, the drain, the request-body reader, and the `ServerContext` handlers use,
built once the engine runs (the app's lifespan).
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import Request
from pydantic import BaseModel

from m3serve.serving.context import ServerContext
from m3serve.serving.errors import APIError
from m3serve.serving.lifecycle import Drain
from m3serve.serving.metrics import ServerMetrics
from m3serve.serving.request_body import read_body
from m3serve.serving.server_args import ServerConfig

logger = logging.getLogger(__name__)


class ServerState:
    """The server-wide state of one app."""

    def __init__(self, client, config: ServerConfig, metrics: ServerMetrics, drain: Drain,
                 make_context: Callable[[], ServerContext]):
        self.client, self.config, self.metrics, self.drain = client, config, metrics, drain
        self._make_context = make_context
        self.context: ServerContext | None = None      # set in the app's lifespan, once the engine runs

    @asynccontextmanager
    async def lifespan(self, app):
        """The app's life: the engine client started (a failure exits the process at once,
        with one line), the context built; at the end both closed."""
        try:
            await self.client.start()
        except RuntimeError as e:       # the engine could not start: one line, exit at once
            logger.debug("engine start-up failure", exc_info=True)
            print(f"m3serve: error: {e}", file=sys.stderr, flush=True)
            os._exit(2)
        self.context = self._make_context()
        try:
            yield
        finally:
            self.context.engine.close()
            self.context.media.close()
            self.client.shutdown()

    @property
    def started(self) -> bool:
        return self.context is not None

    def ctx(self) -> ServerContext:
        """The handlers' context; APIError 503 before the engine is ready."""
        if self.context is None:
            raise APIError(503, "the engine is not ready yet")
        return self.context

    async def read_body(self, request: Request, model: type[BaseModel]) -> BaseModel:
        """The request's body as `model`, within the server's body-size limit."""
        return await read_body(request, model, self.config.max_request_body_bytes)

    async def fresh_stats(self) -> list:
        """Every replica's latest engine stats (fresh when the engine answers quickly)."""
        client = self.client
        if self.started and client.is_healthy():
            try:
                await client.get_stats(timeout_s=2.0)
            except Exception:
                pass
        book = getattr(client, "book", None)
        if book is not None and book.stats_by_replica:
            return [book.stats_by_replica[d] for d in sorted(book.stats_by_replica)]
        return [client.stats]


def server_of(request: Request) -> ServerState:
    """The state of the app serving `request`."""
    return request.app.state.server
