"""The model list and vLLM's tokenizer routes: `GET /v1/models` (and `/v1/models/{id}`),
`POST /tokenize`, `POST /detokenize`; failures in OpenAI's error shape."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request

from m3serve.serving.openai import tokenize as tokenize_api
from m3serve.serving.openai.errors import OpenAIRoute
from m3serve.serving.openai.protocol import DetokenizeRequest, TokenizeRequest
from m3serve.serving.server_state import server_of

router = APIRouter(route_class=OpenAIRoute)


@router.get("/v1/models")
async def models(request: Request):
    return tokenize_api.list_models(server_of(request).ctx())


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    return tokenize_api.retrieve_model(server_of(request).ctx(), model_id)


@router.post("/tokenize")
async def tokenize(request: Request):
    server = server_of(request)
    body = await server.read_body(request, TokenizeRequest)
    ctx = server.ctx()
    out = await ctx.engine.off_loop(tokenize_api.tokenize, ctx, body)
    if body.messages is not None:          # images count as their placeholder tokens
        ids, _ = await ctx.media.prepare(body.messages, out["tokens"])
        out.update(count=len(ids), tokens=ids)
    return out


@router.post("/detokenize")
async def detokenize(request: Request):
    server = server_of(request)
    body = await server.read_body(request, DetokenizeRequest)
    return tokenize_api.detokenize(server.ctx(), body)


def attach_router(app: FastAPI) -> None:
    app.include_router(router)
