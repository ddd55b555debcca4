"""The OpenAI error shape (`{"error": {"message", "type", "param", "code"}}`): the OpenAI
routers' and, outside the paths another dialect claims, the whole server's (probes, unknown
routes, auth)."""
from __future__ import annotations

from fastapi import FastAPI
from starlette.exceptions import HTTPException

from m3serve.serving.errors import ErrorShape, exception_response, register_shape, shaped_route
from m3serve.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                             TokenizeRequest, error_body, param_of)
from m3serve.serving.openai.responses_protocol import ResponsesRequest

# the request fields a ValueError's message may start with: its error's `param`
_FIELDS = frozenset(f for m in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest,
                                ResponsesRequest) for f in m.model_fields)

OPENAI_ERRORS = ErrorShape(error_body, overloaded_status=503, param_of=lambda message: param_of(message, _FIELDS),
                           unauthorized_headers={"WWW-Authenticate": "Bearer"})
OpenAIRoute = shaped_route(OPENAI_ERRORS)

register_shape("/", OPENAI_ERRORS)


def answer_outside_routes(app: FastAPI) -> None:
    """Failures outside every route (an unknown path or method, a bug in a middleware) in
    this shape."""

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return OPENAI_ERRORS.response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        return exception_response(OPENAI_ERRORS, e, request.app.state.server.config.retry_after_s)
