"""Fake prefill/decode/collocated instances and a uvicorn-in-a-thread runner for the router tests.

A FakeInstance is a small FastAPI app that records every body it receives, answers
with canned OpenAI-shaped responses, and registers with the router through the
real RegistrationClient. Knobs (set from the test thread): healthy, fail_status,
delay_s (before the answer), chunk_delay_s, error_event_first, load.
"""
import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tandem.server.registry_protocol import InstanceInfo
from tandem.server.registration import RegistrationClient

STREAM_TEXTS = ["Hello", ",", " world", "!"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class ServerThread:
    """Runs an ASGI app with uvicorn on 127.0.0.1 in a daemon thread."""

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"uvicorn-{self.port}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerThread":
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), 10, f"server on {self.port}")
        if not self.server.started:
            raise RuntimeError(f"server on port {self.port} failed to start")
        return self

    def stop(self) -> None:
        self.signal_stop()
        self.join()

    def signal_stop(self) -> None:
        self.server.should_exit = True

    def join(self) -> None:
        self.thread.join(10)
        assert not self.thread.is_alive(), f"server on {self.port} did not stop"


class FakeInstance:
    def __init__(self, role: str, instance_id: str, registry_address: str, ping_interval_s: float = 0.1):
        self.role = role
        self.instance_id = instance_id
        self.engine_id = f"engine-{instance_id}"
        self.kv_port = free_port()
        self.registry_address = registry_address
        self.ping_interval_s = ping_interval_s
        self.healthy = True
        self.fail_status: int | None = None
        self.delay_s = 0.0
        self.chunk_delay_s = 0.0
        self.error_event_first = False  # a stream starts with an error event (as a decode whose KV never came)
        self.load = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        self.received: list[dict] = []  # {"path", "body", "headers"} per request
        self.cancelled = 0  # requests whose client (the router) went away before the answer ended
        self.completed = 0
        self.registration: RegistrationClient | None = None
        self.server = ServerThread(self._build_app())

    @property
    def url(self) -> str:
        return self.server.url

    def info(self) -> InstanceInfo:
        return InstanceInfo(instance_id=self.instance_id, role=self.role, http_address=self.url,
                            engine_id=self.engine_id, kv_host="127.0.0.1", kv_handshake_port=self.kv_port,
                            kv_notify_port=self.kv_port + 1, tp_size=1, dp_size=1)

    def start(self, register: bool = True) -> "FakeInstance":
        self.server.start()
        if register:
            self.register()
        return self

    def register(self) -> None:
        self.registration = RegistrationClient(self.registry_address, self.info(), self.ping_interval_s,
                                               lambda: dict(self.load))
        self.registration.start()

    def stop_pinging(self, unregister: bool = False) -> None:
        if self.registration is not None:
            self.registration.stop(unregister=unregister)
            self.registration = None


    def bodies(self, path: str | None = None) -> list[dict]:
        return [r["body"] for r in self.received if path is None or r["path"] == path]

    # ---- the app ---------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": self.instance_id}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._generate(request, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._generate(request, "/v1/chat/completions")

        return app

    async def _generate(self, request: Request, path: str):
        body = await request.json()
        self.received.append({"path": path, "body": body, "headers": dict(request.headers)})
        if self.fail_status is not None:
            error = {"error": {"message": f"{self.instance_id} fails on purpose", "type": "server_error",
                               "param": None, "code": self.fail_status}}
            return self._respond([json.dumps(error)], self.fail_status, "application/json")
        kv = body.get("kv_transfer_params")
        if self.role == "decode" and not (isinstance(kv, dict) and kv):
            return JSONResponse({"error": {"message": "decode got no kv_transfer_params",
                                           "type": "invalid_request_error", "param": "kv_transfer_params",
                                           "code": None}}, status_code=400)
        if body.get("stream"):
            events = [f"data: {json.dumps(self._chunk(path, text))}\n\n" for text in STREAM_TEXTS]
            if self.error_event_first:
                error = {"error": {"message": f"{self.instance_id} stream error", "type": "server_error",
                                   "param": None, "code": 500}}
                events.insert(0, f"data: {json.dumps(error)}\n\n")
            return self._respond(events + ["data: [DONE]\n\n"], 200, "text/event-stream")
        answer = {"id": f"cmpl-{self.instance_id}", "object": "text_completion", "model": "fake-model",
                  "served_by": self.instance_id,
                  "choices": [{"index": 0, "text": "".join(STREAM_TEXTS), "finish_reason": "length"}]}
        if self.role == "prefill":
            answer["kv_transfer_params"] = {
                "remote_engine_id": self.engine_id, "remote_block_ids": [3, 4, 5], "remote_host": "127.0.0.1",
                "remote_port": self.kv_port, "remote_request_id": request.headers.get("x-request-id")}
        return self._respond([json.dumps(answer)], 200, "application/json")

    def _chunk(self, path: str, text: str) -> dict:
        if path.endswith("chat/completions"):
            return {"object": "chat.completion.chunk", "served_by": self.instance_id,
                    "choices": [{"index": 0, "delta": {"content": text}}]}
        return {"object": "text_completion", "served_by": self.instance_id, "choices": [{"index": 0, "text": text}]}

    def _respond(self, parts: list[str], status: int, media_type: str) -> StreamingResponse:
        """Answers through a stream even for JSON, so a router that disconnects is noticed (counted
        in self.cancelled)."""

        async def body():
            done = False
            try:
                await asyncio.sleep(self.delay_s)
                for i, part in enumerate(parts):
                    if i:
                        await asyncio.sleep(self.chunk_delay_s)
                    yield part
                done = True
            finally:
                if done:
                    self.completed += 1
                else:
                    self.cancelled += 1

        return StreamingResponse(body(), status_code=status, media_type=media_type)
