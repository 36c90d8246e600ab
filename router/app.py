"""The router's HTTP API (FastAPI) and `run_router`, which serves it with uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (API key
checked when configured), GET /health, GET /metrics, GET /instances.
"""
import logging
import sys
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.router.config import RouterConfig
from tandem.router.errors import RouterError, UpstreamHTTPError, error_response
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import PDOrchestrator
from tandem.router.registry import InstanceRegistry
from tandem.router.upstream import Upstream, make_http_client
from tandem.server.auth import APIKeyMiddleware
from tandem.server.lifecycle import GracefulServer, Lifecycle, PortInUseError, bind_socket, check_port_free
from tandem.server.openapi_errors import document_errors
from tandem.server.registry_protocol import ROLES
from tandem.server.text_check import printable

logger = logging.getLogger(__name__)

# Where /v1/models asks first: decode and collocated instances serve the client's generations.
_MODELS_ROLE_ORDER = ("decode", "collocated", "prefill")


def build_app(config: RouterConfig, lifecycle: Lifecycle | None = None) -> FastAPI:
    """The router app; its registry socket binds and its HTTP client opens at startup (lifespan)."""
    metrics = RouterMetrics()
    lifecycle = lifecycle or Lifecycle()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = make_http_client(config.connect_timeout_s, config.request_timeout_s)
        registry = InstanceRegistry(config, client, metrics)
        try:
            await registry.start()
            app.state.registry = registry
            app.state.orchestrator = PDOrchestrator(config, registry, Upstream(client, registry, metrics), metrics)
            logger.info("router ready: kv_mode=%s routing_policy=%s registry=%s", config.kv_mode,
                        config.routing_policy, registry.address)
            await lifecycle.ready()
            yield
        finally:
            lifecycle.drain()
            await registry.stop()
            await client.close()

    off = {"docs_url": None, "redoc_url": None, "openapi_url": None} if config.disable_docs else {}
    app = FastAPI(title="Tandem router", lifespan=lifespan, **off)
    app.state.config = config
    app.state.metrics = metrics
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    document_errors(app, {"/v1/models": (401, 503), "/v1/": (400, 401, 404, 502, 503, 504)})

    @app.exception_handler(RouterError)
    async def on_router_error(_: Request, exc: RouterError) -> Response:
        if not isinstance(exc, UpstreamHTTPError) and exc.status >= 500:
            logger.warning("request failed with %d: %s", exc.status, exc.message)
        return exc.to_response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(message, exc.status_code, code=str(exc.detail).lower().replace(" ", "_"))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(printable(str(exc)), 400, "invalid_request")

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, exc: Exception) -> Response:
        logger.exception("router bug while serving %s %s", request.method, request.url.path)
        return error_response(f"internal router error: {type(exc).__name__}: {exc}", 500, "internal_error")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await request.app.state.orchestrator.serve(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await request.app.state.orchestrator.serve(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        orchestrator: PDOrchestrator = request.app.state.orchestrator
        failures = []
        for role in _MODELS_ROLE_ORDER:
            for inst in orchestrator.registry.routable(role):
                try:
                    return JSONResponse(await orchestrator.upstream.get_json(inst, "/v1/models"))
                except (RouterError, ValueError) as e:
                    failures.append(f"{inst.instance_id}: {e}")
        detail = "; ".join(failures) if failures else "no healthy instance is registered"
        raise RouterError(f"no instance answered /v1/models ({detail})", 503, "no_instance")

    @app.get("/health")
    async def health(request: Request) -> Response:
        registry: InstanceRegistry = request.app.state.registry
        counts = {role: len(registry.routable(role)) for role in ROLES}
        if lifecycle.status != "ready":
            return JSONResponse({"status": lifecycle.status, "role": "router", "instances": counts}, status_code=503)
        if (counts["prefill"] and counts["decode"]) or counts["collocated"]:
            return JSONResponse({"status": "ok", "role": "router", "instances": counts})
        if counts["prefill"] or counts["decode"]:
            reason = f"no {'decode' if counts['prefill'] else 'prefill'} instance to complete a prefill/decode pair"
        else:
            reason = "no instance registered"
        return JSONResponse({"status": "unavailable", "role": "router", "reason": reason, "instances": counts},
                            status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics(request: Request) -> Response:
        metrics.observe_instances(request.app.state.registry.snapshot())
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/instances")
    async def instances(request: Request) -> Response:
        registry: InstanceRegistry = request.app.state.registry
        return JSONResponse({"kv_mode": config.kv_mode, "routing_policy": config.routing_policy,
                             "registry_address": registry.address, "instances": registry.snapshot()})

    return app


def run_router(config: RouterConfig) -> None:
    """Serve the router until SIGINT/SIGTERM (blocking; SIGTERM drains open requests for up to
    config.shutdown_timeout_s). When its HTTP or registry port is taken it logs why and raises
    SystemExit(1) before serving."""
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(config.host, config.port, "the router's HTTP API")
        if config.registry_port:
            check_port_free(config.registry_host, config.registry_port, "the router registry", "--registry-port")
    except PortInUseError as exc:
        logger.error("%s", exc)
        sys.exit(1)
    lifecycle = Lifecycle()
    server = GracefulServer(uvicorn.Config(build_app(config, lifecycle), log_level=config.log_level, lifespan="on",
                                           timeout_graceful_shutdown=config.shutdown_timeout_s), lifecycle)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
