"""The OpenAPI description states the errors the API really answers: OpenAI error JSON with 400
for invalid requests (FastAPI would document its own 422), plus each route's other statuses.
Schemathesis checks responses against this, so it must be true."""
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "title": "ErrorResponse",
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}},
}
_DESCRIPTIONS = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model or route",
                 502: "an instance failed", 503: "starting, draining, or no engine/instance",
                 504: "an instance did not answer in time"}


STREAMING_PATHS = ("/v1/completions", "/v1/chat/completions")


def document_errors(app: FastAPI, statuses: dict[str, tuple[int, ...]]) -> None:
    """Make `app.openapi()` list, for each path prefix in `statuses`, those error statuses with
    the OpenAI error schema, in place of FastAPI's 422; the generation routes also answer
    text/event-stream (`"stream": true`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = ERROR_SCHEMA
            ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            for path, operations in schema.get("paths", {}).items():
                codes = next((c for prefix, c in statuses.items() if path.startswith(prefix)), ())
                for op in operations.values():
                    responses = op.setdefault("responses", {})
                    responses.pop("422", None)
                    if path in STREAMING_PATHS and "200" in responses:
                        responses["200"].setdefault("content", {})["text/event-stream"] = {
                            "schema": {"description": "SSE events: each data is a JSON chunk, the last [DONE]"}}
                    for code in codes:
                        responses.setdefault(str(code), {"description": _DESCRIPTIONS.get(code, "error"), **ref})
            for name in ("HTTPValidationError", "ValidationError"):
                schema["components"]["schemas"].pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
