"""Errors every API dialect raises and how a dialect answers them.

`APIError` carries an HTTP status; `ClientDisconnected` ends a response nobody reads;
`internal_error` is the client's message for a bug of this server. An `ErrorShape` is one
dialect's error body and status codes; each router owns one, and `exception_response` maps an
exception to that shape's response, so every dialect answers the same failures the same way
in its own words. Routers declare their shape (`shaped_route`) and their paths' (`register_shape`),
so the middlewares that answer before routing (auth, drain) find it too (`shape_for`).
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from m3serve.engine.errors import EngineDeadError, EngineOverloaded, RequestFailed

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


@dataclass(frozen=True)
class ErrorShape:
    """One dialect's errors: `body(status, message, param)` is its JSON error body;
    `overloaded_status` answers an engine whose queue is full; `param_of(message)` names the
    request field a ValueError's message starts with (None: the dialect has no `param`);
    `unauthorized_headers` go with a 401."""

    body: Callable[[int, str, str | None], dict]
    overloaded_status: int = 503
    param_of: Callable[[str], str | None] = lambda message: None
    unauthorized_headers: dict[str, str] | None = None

    def response(self, status: int, message: str, param: str | None = None,
                 headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(status, message, param), status_code=status, headers=headers)


def exception_response(shape: ErrorShape, e: BaseException, retry_after_s: int) -> Response:
    """The response in `shape` of a request that failed with `e`: 400 bad input (naming the
    field where the shape has params), overloaded (with Retry-After), 503 engine not running,
    499 client gone (nobody reads it; nginx's code for "client closed"), 500 a bug here."""
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(e, APIError):
        return shape.response(e.status, e.message, e.param, e.headers)
    if isinstance(e, (ValueError, RequestFailed)):
        return shape.response(400, str(e), shape.param_of(str(e)))
    if isinstance(e, EngineOverloaded):
        return shape.response(shape.overloaded_status, f"server overloaded: {e}", headers=retry)
    if isinstance(e, EngineDeadError):
        return shape.response(503, str(e), headers=retry)
    if isinstance(e, ClientDisconnected):
        return Response(status_code=499)
    return shape.response(500, internal_error(e))      # EngineError, or a bug here


_SHAPES: dict[str, ErrorShape] = {}     # path prefix -> the shape of the router serving it


def register_shape(prefix: str, shape: ErrorShape) -> None:
    """Paths starting with `prefix` answer in `shape` (each router declares its own; the
    longest matching prefix wins)."""
    _SHAPES[prefix] = shape


def shape_for(path: str) -> ErrorShape:
    """The error shape of `path`, for the middlewares that answer before routing (auth, drain)."""
    matches = [prefix for prefix in _SHAPES if path.startswith(prefix)]
    if not matches:
        raise LookupError(f"no error shape is registered for {path!r}")
    return _SHAPES[max(matches, key=len)]


def shaped_route(shape: ErrorShape) -> type[APIRoute]:
    """The route class of a router whose every failure is answered in `shape`
    (`APIRouter(route_class=shaped_route(shape))`)."""

    class ShapedRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def answer(request: Request) -> Response:
                try:
                    return await handler(request)
                except (HTTPException, RequestValidationError):
                    raise                   # FastAPI's own answers (the app's handlers)
                except Exception as e:
                    return exception_response(shape, e, request.app.state.server.config.retry_after_s)
            return answer

    return ShapedRoute
