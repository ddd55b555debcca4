"""The Chat Completions routes: `POST /v1/chat/completions` and its `/render` (the prompt a
request renders to); failures in OpenAI's error shape."""
from __future__ import annotations

import time

from fastapi import APIRouter, FastAPI, Request

from m3serve.serving.openai import chat
from m3serve.serving.openai.errors import OpenAIRoute
from m3serve.serving.openai.protocol import ChatCompletionRequest
from m3serve.serving.server_state import server_of

router = APIRouter(route_class=OpenAIRoute)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request):
    arrival = time.perf_counter()
    server = server_of(request)
    body = await server.read_body(request, ChatCompletionRequest)
    return await chat.create_chat_completion(server.ctx(), body, arrival, request.is_disconnected)


@router.post("/v1/chat/completions/render")
async def render_chat_completion(request: Request):
    server = server_of(request)
    body = await server.read_body(request, ChatCompletionRequest)
    server.ctx().check_model(body.model)
    turn = await chat.prepare(server.ctx(), body)     # images count as their placeholder spans
    return {"prompt": turn.prompt, "token_ids": turn.token_ids}


def attach_router(app: FastAPI) -> None:
    app.include_router(router)
