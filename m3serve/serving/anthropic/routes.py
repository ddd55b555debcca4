"""The Messages API's routes on the server's app, with every failure answered in Anthropic's
error shape (`{"type": "error", "error": {"type", "message"}}`) and status code: 400 bad input
(the message starts with the field's path), 404 unknown model, 413 body too large, 529 engine
overloaded (with Retry-After), 503 engine not running, 500 a bug of this server.
"""
from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from m3serve.core.errors import EngineDeadError, EngineError, EngineOverloaded, RequestFailed
from m3serve.serving.anthropic import messages
from m3serve.serving.anthropic.protocol import OVERLOADED_STATUS, CountTokensRequest, MessagesRequest, error_body
from m3serve.serving.errors import APIError, ClientDisconnected, internal_error

logger = logging.getLogger(__name__)


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


async def _answer(work, retry_after_s: int):
    try:
        return await work()
    except APIError as e:
        return error_response(e.status, e.message, e.headers)
    except (ValueError, RequestFailed) as e:
        return error_response(400, str(e))
    except EngineOverloaded as e:
        return error_response(OVERLOADED_STATUS, f"server overloaded: {e}", {"Retry-After": str(retry_after_s)})
    except EngineDeadError as e:
        return error_response(503, str(e), {"Retry-After": str(retry_after_s)})
    except ClientDisconnected:
        return Response(status_code=499)
    except EngineError as e:
        return error_response(500, internal_error(e))
    except Exception as e:          # a bug here: generic message, details in the log
        return error_response(500, internal_error(e))


def register(app: FastAPI, ctx, read_body, body_limit: int, retry_after_s: int) -> None:
    """Add the Messages API routes. `ctx()` returns the ServerContext (APIError 503 before the
    engine is ready); `read_body(request, model, limit)` reads and validates a body."""

    async def body_of(request: Request, model):
        body = await read_body(request, model, body_limit)
        messages.log_ignored(body, request.headers.get("anthropic-beta"))
        return body

    @app.post("/v1/messages")
    async def create_message(request: Request):
        arrival = time.perf_counter()

        async def work():
            body = await body_of(request, MessagesRequest)
            return await messages.create_message(ctx(), body, arrival, request.is_disconnected)
        return await _answer(work, retry_after_s)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        async def work():
            return await messages.count_tokens(ctx(), await body_of(request, CountTokensRequest))
        return await _answer(work, retry_after_s)

    @app.post("/v1/messages/render")
    async def render(request: Request):
        """The prompt a Messages request renders to (m3serve's, like /v1/chat/completions/render)."""
        async def work():
            body = await body_of(request, CountTokensRequest)
            c = ctx()
            c.check_model(body.model)
            turn, _ = await messages.prepare(c, body)
            return {"prompt": turn.prompt, "token_ids": turn.token_ids}
        return await _answer(work, retry_after_s)
