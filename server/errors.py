"""The one place user-facing errors become OpenAI error JSON: {"error": {message, type, param, code}}."""
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.server.text_check import printable

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error meant for the client: raised where it is detected, rendered by the handlers below."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


class EngineDeadError(APIError):
    """The engine core process is gone; the server is shutting down."""

    def __init__(self, message: str = "the engine core process is not running; the server is shutting down"):
        super().__init__(message, status=503, code="engine_dead")


def error_body(message: str, status: int, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": printable(message), "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.status, err.param, err.code), status_code=err.status)


def stream_error(exc: Exception) -> dict:
    """The error event of a response whose headers are already out (SSE)."""
    if isinstance(exc, APIError):
        return error_body(exc.message, exc.status, exc.param, exc.code)
    logger.error("error while streaming: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return error_body(f"internal error: {type(exc).__name__}: {exc}", 500)


def _describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if param:
        msg = f"{param}: {msg} (got {first.get('input')!r})"
    return msg, param


def install_error_handlers(app: FastAPI) -> None:
    """Map every error the app can raise to OpenAI error JSON (400/401/404/405/500/503)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_error(exc)
        return JSONResponse(error_body(message, 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"route {request.method} {request.url.path} not found"
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """A bug in a route becomes one logged traceback and a 500 error JSON on a connection that
    stays usable (Starlette's own handler re-raises, so uvicorn logs it twice and drops the link)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:  # else the client sees the stream end early; nothing else can be sent
                body = error_body(f"internal error: {type(exc).__name__}: {exc}", 500)
                await JSONResponse(body, status_code=500)(scope, receive, send)
