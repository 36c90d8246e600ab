"""The router's HTTP API (FastAPI) and `run_router`, which serves it with uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (API key
checked when configured), GET /health, GET /metrics, GET /instances.
"""
import logging
import secrets
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.router.config import RouterConfig
from tandem.router.errors import RouterError, UpstreamHTTPError, error_response
from tandem.router.metrics import RouterMetrics
from tandem.router.orchestrator import PDOrchestrator
from tandem.router.protocol import ROLES
from tandem.router.registry import InstanceRegistry
from tandem.router.upstream import Upstream, make_http_client

logger = logging.getLogger(__name__)

# Where /v1/models asks first: decode and collocated instances serve the client's generations.
_MODELS_ROLE_ORDER = ("decode", "collocated", "prefill")


def build_app(config: RouterConfig) -> FastAPI:
    """The router app; its registry socket binds and its HTTP client opens at startup (lifespan)."""
    metrics = RouterMetrics()

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
            yield
        finally:
            await registry.stop()
            await client.aclose()

    app = FastAPI(title="Tandem router", lifespan=lifespan)
    app.state.config = config
    app.state.metrics = metrics

    async def require_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
            raise RouterError("invalid or missing API key: send 'Authorization: Bearer <key>'", 401, "invalid_api_key")

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
        return error_response(str(exc), 400, "invalid_request")

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, exc: Exception) -> Response:
        logger.exception("router bug while serving %s %s", request.method, request.url.path)
        return error_response(f"internal router error: {type(exc).__name__}: {exc}", 500, "internal_error")

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)])
    async def completions(request: Request) -> Response:
        return await request.app.state.orchestrator.serve(request, "/v1/completions")

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
    async def chat_completions(request: Request) -> Response:
        return await request.app.state.orchestrator.serve(request, "/v1/chat/completions")

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
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
        if (counts["prefill"] and counts["decode"]) or counts["collocated"]:
            return JSONResponse({"status": "ok", "instances": counts})
        if counts["prefill"] or counts["decode"]:
            reason = f"no {'decode' if counts['prefill'] else 'prefill'} instance to complete a prefill/decode pair"
        else:
            reason = "no instance registered"
        return JSONResponse({"status": "unavailable", "reason": reason, "instances": counts}, status_code=503)

    @app.get("/metrics")
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
    """Serve the router until SIGINT/SIGTERM (blocking). When it cannot start (HTTP port or registry
    port taken) uvicorn logs why and raises SystemExit with a non-zero code."""
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per upstream request
    server = uvicorn.Server(uvicorn.Config(build_app(config), host=config.host, port=config.port,
                                           log_level=config.log_level, lifespan="on"))
    server.run()
