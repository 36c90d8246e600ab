"""The router's errors and their OpenAI-style JSON form: {"error": {message, type, param, code}}."""
import json

from fastapi.responses import JSONResponse, Response

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    499: "client_closed_request",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


def error_body(message: str, status: int, code: str | None = None, param: str | None = None) -> dict:
    err_type = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(message: str, status: int, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, code, param), status_code=status)


class RouterError(Exception):
    """A request failure the client should see as an OpenAI error JSON with `status`."""

    def __init__(self, message: str, status: int, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param

    def to_response(self) -> Response:
        return error_response(self.message, self.status, self.code, self.param)


class UpstreamHTTPError(RouterError):
    """An instance answered with an error status: its status goes to the client unchanged, and so
    does its body when that is JSON (a plain-text body is wrapped into an error JSON)."""

    def __init__(self, instance_id: str, status: int, content: bytes, content_type: str | None):
        super().__init__(f"instance {instance_id} answered HTTP {status}", status, code="upstream_http_error")
        self.instance_id = instance_id
        self.content = content
        self.content_type = content_type or "application/json"

    def to_response(self) -> Response:
        try:
            json.loads(self.content)
        except ValueError:
            text = self.content.decode("utf-8", "replace").strip()[:2000]
            return error_response(f"{self.message}: {text}" if text else self.message, self.status, self.code)
        return Response(self.content, status_code=self.status, media_type=self.content_type)
