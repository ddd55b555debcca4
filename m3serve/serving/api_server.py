"""The OpenAI-compatible HTTP server: app factory (`build_app`) and `run_server(args)`.

Owns routing, request-body reading (size limit, JSON, pydantic validation), the mapping of
errors to OpenAI error bodies (400 / 401 / 404 / 413 / 500 / 503 with Retry-After), bearer-token
auth, health/readiness, metrics, and the engine client's life cycle (started in the lifespan).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import os
import sys
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from m3serve import envs, memtrace
from m3serve.core.errors import EngineDeadError, EngineError, EngineOverloaded, RequestFailed
from m3serve.serving.anthropic import routes as anthropic_routes
from m3serve.serving.chat_template import load_chat_template
from m3serve.serving.lifecycle import Drain, DrainingServer, describe_engine, raise_fd_limit
from m3serve.serving.metrics import CONTENT_TYPE, ServerMetrics
from m3serve.serving.openai import chat, completions
from m3serve.serving.openai import responses as responses_api
from m3serve.serving.openai import tokenize as tokenize_api
from m3serve.serving.context import ServerContext
from m3serve.serving.errors import APIError, ClientDisconnected, internal_error
from m3serve.version import package_version
from m3serve.serving.serving_engine import ServingEngine
from m3serve.serving.openai.protocol import (MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest,
                                             DetokenizeRequest, TokenizeRequest, check_json, error_body,
                                             param_of, validation_message)
from m3serve.serving.openai.responses_input import ResponseStore
from m3serve.serving.signing import ReasoningSigner
from m3serve.serving.openai.responses_protocol import ResponsesRequest
from m3serve.serving.server_args import ServerConfig

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "minimax-m3-tiny"
# Behind --api-key: the API and its documentation; open: /health, /ready, /metrics, /version,
# /get_load (probes of orchestrators, routers and monitoring).
_PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json", "/debug")
_ANTHROPIC_PREFIX = "/v1/messages"


def _error(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


class _BearerAuth:
    """Pure ASGI middleware (streams and disconnects pass through untouched): the API routes
    need `Authorization: Bearer <api key>` or, as Anthropic clients send it, `x-api-key: <key>`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected, self.key = app, f"Bearer {api_key}".encode(), api_key.encode()
        # vllm-router's P/D legs carry `Bearer $OPENAI_API_KEY` of the router's environment

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES):
            headers = dict(scope["headers"])
            bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            key_ok = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
            if not (bearer_ok or key_ok):
                message = ("invalid or missing API key "
                           "(send 'Authorization: Bearer <key>' or 'x-api-key: <key>')")
                if scope["path"].startswith(_ANTHROPIC_PREFIX):
                    reply = anthropic_routes.error_response(401, message)
                else:
                    reply = _error(401, message, headers={"WWW-Authenticate": "Bearer"})
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


_PARSE_ON_LOOP_BYTES = 64 * 1024     # larger bodies are parsed in a thread


async def _read_body(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if len(body) > _PARSE_ON_LOOP_BYTES:        # a large body is parsed off the event loop
        return await asyncio.to_thread(_parse_body, body, model)
    return _parse_body(body, model)


def _parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, f"request body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:       # JSONDecodeError, and ints of > 4300 digits
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    check_json(data, free_json=getattr(model, "free_json", ()))
    try:
        parsed = model.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(400, message, param) from None
    if parsed.model_extra:
        _log_unknown_fields(model.__name__, sorted(parsed.model_extra))
    return parsed


_unknown_fields_seen: set[tuple] = set()


def _log_unknown_fields(kind: str, names: list[str]) -> None:
    """Unknown fields are logged at INFO the first time a request kind carries them, then at
    debug level (clients such as Codex send the same extra fields on every request)."""
    key = (kind, *names)
    level = logging.DEBUG if key in _unknown_fields_seen else logging.INFO
    if len(_unknown_fields_seen) < 1024:
        _unknown_fields_seen.add(key)
    logger.log(level, "ignoring unknown request fields of %s: %s", kind, names)


def _media_front(client, tokenizer: Tokenizer, config: ServerConfig, processor_settings: dict | None = None):
    from m3serve.config import DEFAULT_MM_LIMITS
    from m3serve.multimodal.media import MediaPolicy
    from m3serve.serving.media_front import MediaFront
    engine = getattr(client, "config", None)
    model = getattr(engine, "model", None)
    limits = getattr(model, "limit_mm_per_prompt", None) or dict(DEFAULT_MM_LIMITS)
    policy = MediaPolicy.from_flags(config.allowed_local_media_path, config.allowed_media_domains,
                                    allow_private_media_addresses=config.allow_private_media_addresses,
                                    max_image_pixels=config.max_image_pixels,
                                    max_video_decoded_bytes=config.max_video_decoded_bytes,
                                    max_video_total_frames=config.max_video_total_frames)
    info = getattr(client, "info", None)
    return MediaFront(tokenizer, policy, limits, getattr(model, "mm_processor_kwargs", None),
                      refusal=getattr(info, "media_refusal", ""), base_settings=processor_settings)


def build_app(client, tokenizer: Tokenizer, model_dir: str | Path, config: ServerConfig,
              model_name: str, kv_transfer=None, sampling_defaults: dict | None = None) -> FastAPI:
    """The FastAPI app. `client` is an `EngineCoreClient` (or a stand-in with its methods); it
    is started when the app starts and shut down when it stops. `kv_transfer`: the engine's
    `config.KVTransferConfig` when it serves prefill or decode legs of P/D. `sampling_defaults`:
    what requests default to (`sampling_defaults.load_sampling_defaults`)."""
    metrics = ServerMetrics(model_name)
    template = (Path(config.chat_template).read_text(encoding="utf-8") if config.chat_template
                else load_chat_template(model_dir))
    from m3serve.multimodal.processor_config import load_processor_settings
    processor_settings = load_processor_settings(model_dir)   # refused here, before the engine starts
    holder: dict[str, ServerContext] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await client.start()
        except RuntimeError as e:       # the engine could not start: one line, exit at once
            logger.debug("engine start-up failure", exc_info=True)
            print(f"m3serve: error: {e}", file=sys.stderr, flush=True)
            os._exit(2)
        holder["ctx"] = ServerContext(
            engine=ServingEngine(client, tokenizer, metrics, sampling_defaults), model_name=model_name,
            model_root=str(model_dir), chat_template=template,
            default_chat_template_kwargs=dict(config.default_chat_template_kwargs),
            reasoning_parser=config.reasoning_parser, tool_call_parser=config.tool_call_parser,
            enable_auto_tool_choice=config.enable_auto_tool_choice,
            kv_transfer=kv_transfer if kv_transfer is not None and kv_transfer.enabled else None,
            stream_interval=config.stream_interval, signer=signer,
            media=_media_front(client, tokenizer, config, processor_settings))
        if getattr(client, "config", None) is not None:
            logger.info(describe_engine(client.config, client.info))
        logger.info("serving %s (%s) on %s", model_name, model_dir, config.url)
        try:
            yield
        finally:
            holder["ctx"].engine.close()
            holder["ctx"].media.close()
            client.shutdown()

    docs = {} if not config.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="m3serve", lifespan=lifespan, **docs)
    if config.api_key:
        app.add_middleware(_BearerAuth, api_key=config.api_key)
    drain = app.state.drain = Drain(config.shutdown_timeout_s, config.retry_after_s, client)
    app.add_middleware(drain.middleware)
    fields = {f for m in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest,
                          ResponsesRequest) for f in m.model_fields}
    signer = ReasoningSigner(config.responses_signing_key)
    responses = responses_api.ResponsesAPI(ResponseStore() if config.enable_response_store else None, signer)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return _error(e.status, e.message, e.param, e.headers)

    @app.exception_handler(ValueError)
    async def _bad_value(_, e: ValueError):
        return _error(400, str(e), param_of(str(e), fields))

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(_, e: EngineOverloaded):
        return _error(503, f"server overloaded: {e}", headers={"Retry-After": str(config.retry_after_s)})

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, e: EngineDeadError):
        return _error(503, str(e), headers={"Retry-After": str(config.retry_after_s)})

    @app.exception_handler(RequestFailed)
    async def _request_failed(_, e: RequestFailed):
        return _error(400, str(e), param_of(str(e), fields))

    @app.exception_handler(EngineError)
    async def _engine_error(_, e: EngineError):
        return _error(500, internal_error(e))

    @app.exception_handler(ClientDisconnected)
    async def _gone(_, e: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        return _error(500, internal_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    def ctx() -> ServerContext:
        if "ctx" not in holder:
            raise APIError(503, "the engine is not ready yet")
        return holder["ctx"]

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():
        """Clients probe the base URL before their first request (Claude Code sends HEAD /)."""
        return {"name": "m3serve", "version": package_version()}

    @app.get("/health")
    async def health():
        if "ctx" in holder and not client.is_healthy():   # started, then lost the engine
            return _error(503, f"the engine is not running: {client.dead_reason}")
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        if drain.draining:
            return _error(503, "the server is shutting down")
        if "ctx" not in holder or not client.is_healthy():
            return _error(503, "the engine is not ready")
        try:
            await client.get_stats(timeout_s=5.0)
        except Exception as e:
            return _error(503, f"the engine is not stepping: {e}")
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics_endpoint():
        if "ctx" in holder and client.is_healthy():
            try:
                metrics.engine_stats = await client.get_stats(timeout_s=2.0)
            except Exception:
                metrics.engine_stats = client.stats  # the engine's last report
        return Response(metrics.render(config.metric_names), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return tokenize_api.list_models(ctx())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return tokenize_api.retrieve_model(ctx(), model_id)

    @app.get("/version")
    async def version():
        return {"version": package_version()}

    async def fresh_stats() -> list:
        """Every replica's latest engine stats (fresh when the engine answers quickly)."""
        if "ctx" in holder and client.is_healthy():
            try:
                await client.get_stats(timeout_s=2.0)
            except Exception:
                pass
        book = getattr(client, "book", None)
        if book is not None and book.stats_by_replica:
            return [book.stats_by_replica[d] for d in sorted(book.stats_by_replica)]
        return [client.stats]

    @app.get("/get_load")
    async def get_load():
        """Requests in the engine (vllm-router's power_of_two policy reads `load`)."""
        return {"load": sum(s.num_running + s.num_waiting for s in await fresh_stats())}

    @app.get("/v1/loads")
    async def loads():
        """Per-replica load in smg's worker-load shape."""
        return tokenize_api.loads(ctx(), await fresh_stats(), getattr(client, "config", None))

    @app.post("/v1/completions/render")
    async def render_completion(request: Request):
        body = await _read_body(request, CompletionRequest, config.max_request_body_bytes)
        ctx().check_model(body.model)
        prompts = await ctx().engine.off_loop(completions.prompts_of, ctx(), body)
        return [{"prompt": text, "token_ids": ids} for text, ids in prompts]

    @app.post("/v1/chat/completions/render")
    async def render_chat_completion(request: Request):
        body = await _read_body(request, ChatCompletionRequest, config.max_request_body_bytes)
        ctx().check_model(body.model)
        turn = await chat.prepare(ctx(), body)     # images count as their placeholder spans
        return {"prompt": turn.prompt, "token_ids": turn.token_ids}

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        arrival = time.perf_counter()
        body = await _read_body(request, CompletionRequest, config.max_request_body_bytes)
        return await completions.create_completion(ctx(), body, arrival, request.is_disconnected)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        arrival = time.perf_counter()
        body = await _read_body(request, ChatCompletionRequest, config.max_request_body_bytes)
        return await chat.create_chat_completion(ctx(), body, arrival, request.is_disconnected)

    anthropic_routes.register(app, ctx, _read_body, config.max_request_body_bytes, config.retry_after_s)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        arrival = time.perf_counter()
        body = await _read_body(request, ResponsesRequest, config.max_request_body_bytes)
        return await responses.create(ctx(), body, arrival, request.is_disconnected)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return responses.retrieve(response_id)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _read_body(request, TokenizeRequest, config.max_request_body_bytes)
        out = await ctx().engine.off_loop(tokenize_api.tokenize, ctx(), body)
        if body.messages is not None:          # images count as their placeholder tokens
            ids, _ = await ctx().media.prepare(body.messages, out["tokens"])
            out.update(count=len(ids), tokens=ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _read_body(request, DetokenizeRequest, config.max_request_body_bytes)
        return tokenize_api.detokenize(ctx(), body)

    if memtrace.start(envs.debug_tracemalloc_frames()):
        @app.get("/debug/tracemalloc")
        async def debug_tracemalloc(top: int = 0, group: str = "lineno"):
            """M3SERVE_DEBUG_TRACEMALLOC only: this process's memtrace reading (`top` largest
            allocation sites) and each engine replica's traced bytes."""
            api = memtrace.reading(top, group)
            engine = [s.traced_bytes for s in await client.get_state()] if "ctx" in holder else []
            return {"api": api, "engine_traced_bytes": engine}

    return app


def listen_socket(host: str, port: int):
    """The server's listening socket, bound now: before minutes of model loading (a port in
    use is a start-up error at once), and so that no other socket the engine's processes open
    in the meantime can take the port. ValueError when it cannot be bound."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # as uvicorn binds
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}"
                         f"{' (another process holds the port; pick another with --port)' if e.errno == 98 else ''}") from None
    return s


def run_server(args) -> None:
    """`m3serve serve`: resolve the model, then run uvicorn; the engine process is spawned when
    the app starts and stopped with it."""
    import uvicorn

    from m3serve.config import EngineConfig
    from m3serve.core.core_client import EngineCoreClient, engine_config_for_process
    from m3serve.engine_args import engine_kwargs
    from m3serve.model.files import load_tokenizer, model_directory
    from m3serve.plan import check_checkpoint_layout
    from m3serve.sampling_defaults import describe as describe_defaults
    from m3serve.sampling_defaults import load_sampling_defaults
    from m3serve.serving.server_args import not_applicable_given, server_config

    server = server_config(args)
    engine = EngineConfig.from_kwargs(**engine_kwargs(args))
    for line in not_applicable_given(args):
        logger.info("accepted, not applicable: %s", line)
    if engine.compilation.not_applicable:
        logger.info("--compilation-config keys not applicable here, ignored: %s", engine.compilation.not_applicable)
    if engine.parallel.node_rank > 0:     # another host of a multi-node engine: no API here
        from m3serve.core.engine_group import run_headless
        raise SystemExit(run_headless(engine))
    sock = listen_socket(server.host, server.port)
    logger.info("listening on %s; /ready answers 200 once the model is loaded", server.url)
    model_dir = model_directory(engine.model.model)
    check_checkpoint_layout(model_dir, engine.model, engine.parallel)
    name = server.served_model_name or engine.model.model or TINY_MODEL_NAME
    client = EngineCoreClient(engine_config_for_process(engine, model_dir), server.engine_ready_timeout_s)
    defaults = load_sampling_defaults(engine.generation, model_dir)
    logger.info(describe_defaults(defaults))
    app = build_app(client, load_tokenizer(model_dir), model_dir, server, name, engine.kv_transfer, defaults)
    raise_fd_limit(engine.scheduler.max_num_seqs, engine.scheduler.max_waiting_requests)
    uv = DrainingServer(uvicorn.Config(app, host=server.host, port=server.port, log_level=server.uvicorn_log_level,
                                       timeout_graceful_shutdown=5, **server.uvicorn_ssl_kwargs()), app.state.drain)
    uv.run(sockets=[sock])
    if uv.drain.forced:
        raise SystemExit(1)
