"""The API key, shared by the API server and the router: where it comes from (resolve_api_key, at
the CLI) and the check: with a key set, the OpenAI routes (/v1/...), /tokenize and /detokenize,
and the API description (/docs, /redoc, /openapi.json) need `Authorization: Bearer <key>`.
/health and /metrics stay open: load balancers and Prometheus probe them without secrets, and
they carry no prompts, outputs or keys."""
import argparse
import os
import secrets

from fastapi.responses import JSONResponse

from tandem.server.errors import error_body

API_KEY_ENV = "TANDEM_API_KEY"
PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json", "/instances")


class APIKeyMiddleware:
    """401 on protected routes unless the bearer key matches (plain ASGI: streams untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES)
                and scope["method"] != "OPTIONS"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                body = error_body("invalid or missing API key (send `Authorization: Bearer <key>`)", 401,
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The API key from --api-key, else --api-key-file, else $TANDEM_API_KEY (the one environment
    variable Tandem reads, at the CLI layer only: the `server` and `python -m tandem.router` CLIs)."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                key = f.readline().strip()
        except OSError as exc:
            raise SystemExit(f"server: --api-key-file {args.api_key_file}: {exc.strerror}")
        if not key:
            raise SystemExit(f"server: --api-key-file {args.api_key_file} is empty")
        return key
    return os.environ.get(API_KEY_ENV) or None
