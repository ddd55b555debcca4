"""The Completions routes: `POST /v1/completions` and its `/render` (each prompt's text and
token ids); failures in OpenAI's error shape."""
from __future__ import annotations

import time

from fastapi import APIRouter, FastAPI, Request

from m3serve.serving.openai import completions
from m3serve.serving.openai.errors import OpenAIRoute
from m3serve.serving.openai.protocol import CompletionRequest
from m3serve.serving.server_state import server_of

router = APIRouter(route_class=OpenAIRoute)


@router.post("/v1/completions")
async def create_completion(request: Request):
    arrival = time.perf_counter()
    server = server_of(request)
    body = await server.read_body(request, CompletionRequest)
    return await completions.create_completion(server.ctx(), body, arrival, request.is_disconnected)


@router.post("/v1/completions/render")
async def render_completion(request: Request):
    server = server_of(request)
    body = await server.read_body(request, CompletionRequest)
    ctx = server.ctx()
    ctx.check_model(body.model)
    prompts = await ctx.engine.off_loop(completions.prompts_of, ctx, body)
    return [{"prompt": text, "token_ids": ids} for text, ids in prompts]


def attach_router(app: FastAPI) -> None:
    app.include_router(router)
