"""The FastAPI app: OpenAI routes, health/version/metrics, API-key check, disconnect -> abort.

The app serves from the moment its socket is bound: while the engine loads the model, /health
answers 503 {"status": "starting"} and the OpenAI routes 503; then it turns ready (and runs the
lifecycle's on_ready callbacks, e.g. router registration)."""
import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tandem.engine.config import EngineConfig
from tandem.server import __version__
from tandem.server.auth import APIKeyMiddleware
from tandem.server.chat import create_chat_completion
from tandem.server.completions import create_completion
from tandem.server.disconnect import ClientDisconnected, cancel_on_disconnect
from tandem.server.engine_client import EngineClient
from tandem.server.errors import APIError, EngineDeadError, error_body, install_error_handlers
from tandem.server.generation import ServingContext, generation_defaults
from tandem.server.lifecycle import Lifecycle
from tandem.server.metrics import CONTENT_TYPE, ServerMetrics
from tandem.server.openapi_errors import document_errors
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, now
from tandem.server.text_check import find_invalid_text
from tandem.server.tokenizer import Tokenizer
from tandem.server.tokenize_routes import tokenize_router

logger = logging.getLogger(__name__)


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


def _on_gpu(config: EngineConfig) -> bool:
    device = config.model.device
    if device == "auto":
        import torch
        return torch.cuda.is_available()
    return device != "cpu"


def build_app(client: EngineClient, config: EngineConfig, tokenizer: Tokenizer | None = None,
              api_key: str | None = None, *, role: str = "collocated", lifecycle: Lifecycle | None = None,
              docs: bool = True) -> FastAPI:
    """The app for an EngineClient that is started (`client.info` set once ready; if it is not
    yet, the app waits for it in the background). `tokenizer` may be preloaded."""
    lifecycle = lifecycle or Lifecycle()
    name, serving_config = served_model_name(config), config.serving

    def make_context(tok: Tokenizer | None) -> ServingContext:
        info = client.info
        if tok is None or tok.path != info.tokenizer_path:
            tok = Tokenizer(info.tokenizer_path)
        if serving_config.chat_template is not None:
            tok.set_chat_template(serving_config.chat_template)
        tool_parser = serving_config.tool_call_parser if serving_config.enable_auto_tool_choice else None
        return ServingContext(client=client, tokenizer=tok, model_name=name, model_path=config.model.model,
                              max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                              metrics=ServerMetrics(name), served_names=served_model_names(config),
                              defaults=generation_defaults(serving_config.generation_config, config.model.model),
                              tool_parser=tool_parser)

    async def warm_up(app: FastAPI) -> None:
        """One streamed completion through the whole stack (routes, validation, engine client,
        detokenizer, SSE) before ready, so first-time costs that compile-ahead does not reach land
        in start-up instead of on the first client's TTFT. It counts in /metrics like any request."""
        import httpx

        ctx = app.state.ctx
        body = {"model": name, "prompt": [i % ctx.vocab_size for i in range(min(256, ctx.max_model_len // 2))],
                "max_tokens": 2, "stream": True, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        t0 = time.perf_counter()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://warm-up") as http:
            resp = await http.post("/v1/completions", json=body, headers=headers, timeout=600)
        if resp.status_code != 200:
            raise RuntimeError(f"the start-up warm-up request failed: {resp.status_code} {resp.text[:500]}")
        logger.info("warm-up request served in %.1f ms", (time.perf_counter() - t0) * 1e3)

    async def become_ready(app: FastAPI) -> None:
        try:
            if app.state.ctx is None:
                if client.info is None:
                    await asyncio.to_thread(client.wait_ready)
                app.state.ctx = await asyncio.to_thread(make_context, tokenizer)
            await client.start_output_loop()
            if _on_gpu(config):
                await warm_up(app)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the engine failed to start: the caller logs it and exits non-zero
            lifecycle.fail(exc)
            return
        await lifecycle.ready()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        starting = asyncio.create_task(become_ready(app), name="become-ready")
        try:
            yield
        finally:
            lifecycle.drain()
            if not starting.done():
                client.cancel_start()
                starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await client.stop_output_loop()

    off = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Tandem", version=__version__, lifespan=lifespan, **off)
    app.state.ctx = None
    if client.info is not None:  # already loaded (tests): ready at once; on_ready still runs in lifespan
        app.state.ctx = make_context(tokenizer)
        lifecycle.status = "ready"
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    document_errors(app, {"/v1/models": (401,), "/v1/": (400, 401, 404, 503), "/tokenize": (400, 401, 404, 503),
                          "/detokenize": (400, 401, 404, 503)})

    def serving(body=None) -> ServingContext:
        ctx = app.state.ctx
        if ctx is None:
            raise APIError(f"the server is {lifecycle.status} (the model is not loaded); retry when /health "
                           "answers 200", status=503, code="server_not_ready")
        if body is not None:
            bad = find_invalid_text(body)
            if bad is not None:
                raise APIError(bad, param=bad.split(":", 1)[0])
        return ctx

    @app.get("/health", responses={503: {"description": "starting, draining, failed, or the engine died"}})
    async def health() -> Response:
        body = {"status": lifecycle.status, "role": role, "model": name}
        if client.dead or not all(p.is_alive() for p in client.procs):
            dead = EngineDeadError()
            return JSONResponse({**body, "status": "dead", **error_body(dead.message, 503, code=dead.code)},
                                status_code=503)
        return JSONResponse(body, status_code=200 if lifecycle.status == "ready" else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": served, "object": "model", "created": now(), "owned_by": "tandem", "root": config.model.model,
            "parent": None, "max_model_len": client.info.max_model_len if client.info else None}
            for served in served_model_names(config)]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        ctx = app.state.ctx
        if ctx is None:
            return Response("", media_type=CONTENT_TYPE)
        ctx.metrics.set_engine_stats(await client.get_stats())
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _cancel_on_disconnect(request, create_completion(serving(body), body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _cancel_on_disconnect(request, create_chat_completion(serving(body), body))

    app.include_router(tokenize_router(serving))
    return app
