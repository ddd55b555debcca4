"""`GET /v1/models` (and `/v1/models/{id}`), `POST /tokenize` and `POST /detokenize` (vLLM's shapes)."""
from __future__ import annotations

from m3serve.serving.chat_template import render_chat, template_kwargs
from m3serve.serving.context import ServerContext
from m3serve.version import package_version
from m3serve.serving.errors import APIError
from m3serve.serving.openai.protocol import DetokenizeRequest, TokenizeRequest


def list_models(ctx: ServerContext) -> dict:
    return {"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "m3serve",
        "root": ctx.model_root, "parent": None, "max_model_len": ctx.engine.max_model_len}]}


def retrieve_model(ctx: ServerContext, model_id: str) -> dict:
    """`GET /v1/models/{id}`: the entry of /v1/models with that id; APIError 404 for another."""
    for model in list_models(ctx)["data"]:
        if model["id"] == model_id:
            return model
    raise APIError(404, f"The model `{model_id}` does not exist.", "model")


def tokenize(ctx: ServerContext, request: TokenizeRequest) -> dict:
    ctx.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise ValueError("tokenize needs exactly one of prompt or messages")
    if request.messages is not None:
        kwargs = template_kwargs(ctx.default_chat_template_kwargs, request.chat_template_kwargs,
                                 request.reasoning_effort)
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


def loads(ctx: ServerContext, stats: list, engine_config=None) -> dict:
    """`GET /v1/loads`: one entry per DP replica, in smg's worker-load shape."""
    import datetime

    block_size = ctx.engine.block_size
    max_seqs = engine_config.scheduler.max_num_seqs if engine_config is not None else 0
    role = ctx.kv_transfer.kv_role if ctx.kv_transfer is not None else None
    mode = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(role, "null")
    entries = []
    for rank, s in enumerate(stats):
        rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        entries.append({"dp_rank": rank, "num_running_reqs": s.num_running, "num_waiting_reqs": s.num_waiting,
                        "num_total_reqs": s.num_running + s.num_waiting,
                        "num_used_tokens": (s.num_usable_blocks - s.num_free_blocks) * block_size,
                        "max_total_num_tokens": s.num_usable_blocks * block_size, "max_running_requests": max_seqs,
                        "token_usage": s.kv_cache_usage, "cache_hit_rate": rate, "disagg_mode": mode})
    running = sum(e["num_running_reqs"] for e in entries)
    waiting = sum(e["num_waiting_reqs"] for e in entries)
    return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": package_version(),
            "dp_rank_count": len(entries), "loads": entries,
            "aggregate": {"total_running_reqs": running, "total_waiting_reqs": waiting,
                          "total_reqs": running + waiting,
                          "avg_token_usage": sum(e["token_usage"] for e in entries) / max(1, len(entries))}}
