"""The server's own routes, for probes, routers and monitoring: `/` (the base URL clients
probe), `/health`, `/ready`, `/metrics`, `/version`, `/get_load` (vllm-router), `/v1/loads`
(smg) and, when enabled, `/debug/tracemalloc`; failures in OpenAI's error shape, the server's
default."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from m3serve import memtrace
from m3serve.serving.metrics import CONTENT_TYPE
from m3serve.serving.openai import tokenize as tokenize_api
from m3serve.serving.openai.errors import OPENAI_ERRORS, OpenAIRoute
from m3serve.serving.server_state import server_of
from m3serve.version import package_version

router = APIRouter(route_class=OpenAIRoute)


def _unavailable(message: str) -> Response:
    return OPENAI_ERRORS.response(503, message)


@router.api_route("/", methods=["GET", "HEAD"])
async def root():
    """Clients probe the base URL before their first request (Claude Code sends HEAD /)."""
    return {"name": "m3serve", "version": package_version()}


@router.get("/health")
async def health(request: Request):
    server = server_of(request)
    if server.started and not server.client.is_healthy():   # started, then lost the engine
        return _unavailable(f"the engine is not running: {server.client.dead_reason}")
    return Response(status_code=200)


@router.get("/ready")
async def ready(request: Request):
    server = server_of(request)
    if server.drain.draining:
        return _unavailable("the server is shutting down")
    if not server.started or not server.client.is_healthy():
        return _unavailable("the engine is not ready")
    try:
        await server.client.get_stats(timeout_s=5.0)
    except Exception as e:
        return _unavailable(f"the engine is not stepping: {e}")
    return {"status": "ready"}


@router.get("/metrics")
async def metrics_endpoint(request: Request):
    server = server_of(request)
    client, metrics = server.client, server.metrics
    if server.started and client.is_healthy():
        try:
            metrics.engine_stats = await client.get_stats(timeout_s=2.0)
        except Exception:
            metrics.engine_stats = client.stats  # the engine's last report
    return Response(metrics.render(server.config.metric_names), media_type=CONTENT_TYPE)


@router.get("/version")
async def version():
    return {"version": package_version()}


@router.get("/get_load")
async def get_load(request: Request):
    """Requests in the engine (vllm-router's power_of_two policy reads `load`)."""
    return {"load": sum(s.num_running + s.num_waiting for s in await server_of(request).fresh_stats())}


@router.get("/v1/loads")
async def loads(request: Request):
    """Per-replica load in smg's worker-load shape."""
    server = server_of(request)
    return tokenize_api.loads(server.ctx(), await server.fresh_stats(), getattr(server.client, "config", None))


debug_router = APIRouter(route_class=OpenAIRoute)


@debug_router.get("/debug/tracemalloc")
async def debug_tracemalloc(request: Request, top: int = 0, group: str = "lineno"):
    """M3SERVE_DEBUG_TRACEMALLOC only: this process's memtrace reading (`top` largest
    allocation sites) and each engine replica's traced bytes."""
    server = server_of(request)
    api = memtrace.reading(top, group)
    engine = [s.traced_bytes for s in await server.client.get_state()] if server.started else []
    return {"api": api, "engine_traced_bytes": engine}


def attach_router(app: FastAPI) -> None:
    app.include_router(router)


def attach_debug_router(app: FastAPI) -> None:
    """The debug routes (M3SERVE_DEBUG_TRACEMALLOC), protected like the API."""
    app.include_router(debug_router)
