"""The Responses routes: `POST /v1/responses` and `GET /v1/responses/{id}` (with
--enable-response-store); failures in OpenAI's error shape."""
from __future__ import annotations

import time

from fastapi import APIRouter, FastAPI, Request

from m3serve.serving.openai.errors import OpenAIRoute
from m3serve.serving.openai.responses import ResponsesAPI
from m3serve.serving.openai.responses_input import ResponseStore
from m3serve.serving.openai.responses_protocol import ResponsesRequest
from m3serve.serving.server_state import server_of
from m3serve.serving.signing import ReasoningSigner

router = APIRouter(route_class=OpenAIRoute)


def _responses(request: Request) -> ResponsesAPI:
    return request.app.state.responses


@router.post("/v1/responses")
async def create_response(request: Request):
    arrival = time.perf_counter()
    server = server_of(request)
    body = await server.read_body(request, ResponsesRequest)
    return await _responses(request).create(server.ctx(), body, arrival, request.is_disconnected)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    return _responses(request).retrieve(response_id)


def attach_router(app: FastAPI, signer: ReasoningSigner, enable_store: bool) -> None:
    """`signer` signs reasoning that travels through clients (`encrypted_content`);
    `enable_store`: keep responses for `previous_response_id` and retrieval."""
    app.state.responses = ResponsesAPI(ResponseStore() if enable_store else None, signer)
    app.include_router(router)
