"""The OpenAI- and Anthropic-compatible HTTP server: the app (`build_app`, a list of routers)
and `run_server(args)`.

Each router owns its paths and its error shape (`serving.errors`); the app adds bearer-token
auth, the drain, the shape of failures outside every route (unknown paths), and the engine
client's life cycle (started in the lifespan, which builds the handlers' `ServerContext`).
"""
from __future__ import annotations

import functools
import hmac
import logging
from pathlib import Path

from fastapi import FastAPI
from tokenizers import Tokenizer

from m3serve import envs, memtrace
from m3serve.serving import ops_router
from m3serve.serving.anthropic import messages_router
from m3serve.serving.chat_template import load_chat_template
from m3serve.serving.context import ServerContext
from m3serve.serving.errors import shape_for
from m3serve.serving.lifecycle import Drain, DrainingServer, describe_engine, raise_fd_limit
from m3serve.serving.metrics import ServerMetrics
from m3serve.serving.openai import chat_router, completions_router, responses_router, tokenize_router
from m3serve.serving.openai import errors as openai_errors
from m3serve.serving.server_args import ServerConfig
from m3serve.serving.server_state import ServerState
from m3serve.serving.serving_engine import ServingEngine
from m3serve.serving.signing import ReasoningSigner

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "minimax-m3-tiny"
# Behind --api-key: the API and its documentation; open: /health, /ready, /metrics, /version,
# /get_load (probes of orchestrators, routers and monitoring).
_PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json", "/debug")


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
                shape = shape_for(scope["path"])
                reply = shape.response(401, message, headers=shape.unauthorized_headers)
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


def _server_context(client, tokenizer: Tokenizer, model_dir: str | Path, config: ServerConfig, model_name: str,
                    metrics: ServerMetrics, signer: ReasoningSigner, kv_transfer, sampling_defaults: dict | None,
                    template: str, processor_settings: dict | None) -> ServerContext:
    """The handlers' context, once the engine runs."""
    context = ServerContext(
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
    return context


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
    signer = ReasoningSigner(config.responses_signing_key)
    make_context = functools.partial(_server_context, client, tokenizer, model_dir, config, model_name, metrics,
                                     signer, kv_transfer, sampling_defaults, template, processor_settings)
    server = ServerState(client, config, metrics, Drain(config.shutdown_timeout_s, config.retry_after_s, client),
                         make_context)

    docs = {} if not config.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="m3serve", lifespan=server.lifespan, **docs)
    app.state.server, app.state.drain = server, server.drain
    if config.api_key:
        app.add_middleware(_BearerAuth, api_key=config.api_key)
    app.add_middleware(server.drain.middleware)
    openai_errors.answer_outside_routes(app)
    ops_router.attach_router(app)
    tokenize_router.attach_router(app)
    completions_router.attach_router(app)
    chat_router.attach_router(app)
    messages_router.attach_router(app)
    responses_router.attach_router(app, signer, config.enable_response_store)
    if memtrace.start(envs.debug_tracemalloc_frames()):
        ops_router.attach_debug_router(app)
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

    from m3serve.engine.core_client import EngineCoreClient, engine_config_for_process
    from m3serve.engine_args import build_engine_config, engine_kwargs
    from m3serve.model.files import load_tokenizer, model_directory
    from m3serve.plan import check_checkpoint_layout
    from m3serve.sampling_defaults import describe as describe_defaults
    from m3serve.sampling_defaults import load_sampling_defaults
    from m3serve.serving.server_args import not_applicable_given, server_config

    server = server_config(args)
    engine = build_engine_config(**engine_kwargs(args))
    for line in not_applicable_given(args):
        logger.info("accepted, not applicable: %s", line)
    if engine.compilation.not_applicable:
        logger.info("--compilation-config keys not applicable here, ignored: %s", engine.compilation.not_applicable)
    if engine.parallel.node_rank > 0:     # another host of a multi-node engine: no API here
        from m3serve.engine.engine_group import run_headless
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
