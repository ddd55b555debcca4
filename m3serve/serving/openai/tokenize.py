"""`GET /v1/models`, `POST /tokenize` and `POST /detokenize` (vLLM's shapes)."""
from __future__ import annotations

from m3serve.serving.chat_template import render_chat
from m3serve.serving.openai.common import ServerContext
from m3serve.serving.openai.protocol import DetokenizeRequest, TokenizeRequest


def list_models(ctx: ServerContext) -> dict:
    return {"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "m3serve",
        "root": ctx.model_root, "parent": None, "max_model_len": ctx.engine.max_model_len}]}


def tokenize(ctx: ServerContext, request: TokenizeRequest) -> dict:
    ctx.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise ValueError("tokenize needs exactly one of prompt or messages")
    if request.messages is not None:
        kwargs = {**ctx.default_chat_template_kwargs, **(request.chat_template_kwargs or {})}
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        text = render_chat(ctx.chat_template, request.messages, tools=tools,
                           add_generation_prompt=request.add_generation_prompt, chat_template_kwargs=kwargs)
        ids = ctx.engine.encode(text)
    else:
        ids = ctx.engine.encode(request.prompt, request.add_special_tokens)
    return {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids}


def detokenize(ctx: ServerContext, request: DetokenizeRequest) -> dict:
    ctx.check_model(request.model)
    ctx.engine.check_token_ids(request.tokens, "tokens")
    return {"prompt": ctx.engine.tokenizer.decode(request.tokens, skip_special_tokens=False)}
