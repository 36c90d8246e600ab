"""The FastAPI app: OpenAI routes, health/version/metrics, API-key check, disconnect -> abort."""
import logging
import secrets
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.engine.config import EngineConfig
from tandem.server import __version__
from tandem.server.chat import create_chat_completion
from tandem.server.completions import create_completion
from tandem.router.disconnect import ClientDisconnected, cancel_on_disconnect
from tandem.server.engine_client import EngineClient
from tandem.server.errors import EngineDeadError, error_body, error_response, install_error_handlers
from tandem.server.generation import ServingContext, generation_defaults
from tandem.server.metrics import CONTENT_TYPE, ServerMetrics
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, now
from tandem.server.tokenizer import Tokenizer
from tandem.server.tokenize_routes import tokenize_router

logger = logging.getLogger(__name__)


class APIKeyMiddleware:
    """401 on /v1 routes unless `Authorization: Bearer <key>` matches (plain ASGI: streams untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                body = error_body("invalid or missing API key (send `Authorization: Bearer <key>`)", 401,
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _cancel_on_disconnect(request: Request, handler):
    """Run a route handler, cancelling it (and so aborting its engine requests) if the client
    goes away before the response is ready."""
    try:
        return await cancel_on_disconnect(request, handler)
    except ClientDisconnected:
        logger.info("client disconnected from %s; request aborted", request.url.path)
        return Response(status_code=499)


def served_model_names(config: EngineConfig) -> tuple[str, ...]:
    """--served-model-name (one or more), else the model folder's name."""
    names = config.model.served_model_name
    names = (names,) if isinstance(names, str) else tuple(names or ())
    return names or (Path(config.model.model.rstrip("/")).name,)


def served_model_name(config: EngineConfig) -> str:
    return served_model_names(config)[0]


def build_app(client: EngineClient, config: EngineConfig, tokenizer: Tokenizer | None = None,
              api_key: str | None = None) -> FastAPI:
    """The app for a ready EngineClient (its `info` is set); `tokenizer` may be preloaded."""
    info = client.info
    if tokenizer is None or tokenizer.path != info.tokenizer_path:
        tokenizer = Tokenizer(info.tokenizer_path)
    name, serving = served_model_name(config), config.serving
    if serving.chat_template is not None:
        tokenizer.set_chat_template(serving.chat_template)
    ctx = ServingContext(client=client, tokenizer=tokenizer, model_name=name,
                         model_path=config.model.model, max_model_len=info.max_model_len,
                         vocab_size=info.vocab_size, metrics=ServerMetrics(name),
                         served_names=served_model_names(config),
                         defaults=generation_defaults(serving.generation_config, config.model.model),
                         tool_parser=serving.tool_call_parser if serving.enable_auto_tool_choice else None)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await client.start_output_loop()
        yield
        await client.stop_output_loop()

    app = FastAPI(title="Tandem", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        if client.dead or not all(p.is_alive() for p in client.procs):
            return error_response(EngineDeadError())
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": served, "object": "model", "created": now(), "owned_by": "tandem", "root": config.model.model,
            "parent": None, "max_model_len": info.max_model_len} for served in ctx.served_names]}

    @app.get("/metrics")
    async def metrics() -> Response:
        ctx.metrics.set_engine_stats(await client.get_stats())
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _cancel_on_disconnect(request, create_completion(ctx, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _cancel_on_disconnect(request, create_chat_completion(ctx, body))

    app.include_router(tokenize_router(ctx))
    return app
