"""The Messages API's routes, with every failure answered in Anthropic's error shape
(`{"type": "error", "error": {"type", "message"}}`) and status code: 400 bad input (the message
starts with the field's path), 404 unknown model, 413 body too large, 529 engine overloaded
(with Retry-After), 503 engine not running, 500 a bug of this server.
"""
from __future__ import annotations

import time

from fastapi import APIRouter, FastAPI, Request

from m3serve.serving.anthropic import messages
from m3serve.serving.anthropic.protocol import OVERLOADED_STATUS, CountTokensRequest, MessagesRequest, error_body
from m3serve.serving.errors import ErrorShape, register_shape, shaped_route
from m3serve.serving.server_state import server_of

ANTHROPIC_ERRORS = ErrorShape(lambda status, message, param: error_body(status, message),
                              overloaded_status=OVERLOADED_STATUS)
PREFIX = "/v1/messages"

router = APIRouter(route_class=shaped_route(ANTHROPIC_ERRORS))
register_shape(PREFIX, ANTHROPIC_ERRORS)


async def _body(request: Request, model):
    body = await server_of(request).read_body(request, model)
    messages.log_ignored(body, request.headers.get("anthropic-beta"))
    return body


@router.post(PREFIX)
async def create_message(request: Request):
    arrival = time.perf_counter()
    body = await _body(request, MessagesRequest)
    return await messages.create_message(server_of(request).ctx(), body, arrival, request.is_disconnected)


@router.post(PREFIX + "/count_tokens")
async def count_tokens(request: Request):
    return await messages.count_tokens(server_of(request).ctx(), await _body(request, CountTokensRequest))


@router.post(PREFIX + "/render")
async def render(request: Request):
    """The prompt a Messages request renders to (m3serve's, like /v1/chat/completions/render)."""
    body = await _body(request, CountTokensRequest)
    ctx = server_of(request).ctx()
    ctx.check_model(body.model)
    turn, _ = await messages.prepare(ctx, body)
    return {"prompt": turn.prompt, "token_ids": turn.token_ids}


def attach_router(app: FastAPI) -> None:
    app.include_router(router)
