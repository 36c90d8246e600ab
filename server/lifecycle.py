"""An API server's life: starting (HTTP up, model loading) -> ready -> draining (SIGTERM: no new
connections, in-flight requests finish within the shutdown timeout), or failed (the engine did
not start). /health answers 200 only while ready. Shared by the API server and the router."""
import asyncio
import inspect
import logging
import signal
import socket
from collections.abc import Awaitable, Callable

import uvicorn

logger = logging.getLogger(__name__)

Callback = Callable[[], Awaitable[None] | None]


class PortInUseError(RuntimeError):
    """A port the process must listen on is taken (raised before any model is loaded)."""


class StopRequested(BaseException):
    """SIGINT/SIGTERM outside uvicorn's own handling (start-up, or re-raised by uvicorn after its
    stop): install `raise_stop` for both, catch this, exit 0."""


def raise_stop(signum: int, frame) -> None:
    """A signal handler: raise StopRequested("SIGTERM" / "SIGINT")."""
    raise StopRequested(signal.Signals(signum).name)


class Lifecycle:
    """The server's status and what runs when it changes (`on_ready`: e.g. register with the router;
    `on_drain`: e.g. unregister, so the router stops sending new requests)."""

    def __init__(self) -> None:
        self.status = "starting"  # starting | ready | draining | failed
        self.error: BaseException | None = None
        self.on_ready: list[Callback] = []
        self.on_drain: list[Callable[[], None]] = []
        self.on_failed: list[Callable[[], None]] = []
        self._ready_once = False

    async def ready(self) -> None:
        """Mark ready (unless draining already) and run the on_ready callbacks, once."""
        if self._ready_once:
            return
        self._ready_once = True
        if self.status == "starting":
            self.status = "ready"
        for callback in self.on_ready:
            result = callback()
            if inspect.isawaitable(result):
                await result

    def drain(self) -> None:
        if self.status in ("starting", "ready"):
            self.status = "draining"
            for callback in self.on_drain:
                callback()

    def fail(self, exc: BaseException) -> None:
        self.status, self.error = "failed", exc
        for callback in self.on_failed:
            callback()


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT marks the lifecycle draining (uvicorn then stops
    accepting and waits for open requests up to `timeout_graceful_shutdown`, then cancels them)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            logger.info("%s: draining: no new connections; open requests get %.0f s to finish",
                        signal.Signals(sig).name, self.config.timeout_graceful_shutdown or 0)
        self.lifecycle.drain()
        super().handle_exit(sig, frame)

    async def wait_started(self) -> None:
        while not self.started:
            await asyncio.sleep(0.02)


def bind_socket(host: str, port: int, what: str, flag: str = "--port") -> socket.socket:
    """A TCP socket bound to host:port (uvicorn serves on it later); PortInUseError when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets of
    # that proto; with Nagle on, a streamed chunk sent right after the headers waits for the
    # client's delayed ACK (40 ms on Linux)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUseError(f"cannot listen on {host}:{port} for {what}: {exc.strerror}; another process holds "
                             f"it (stop it or choose another {flag})") from None
    sock.listen(2048)  # connections wait in the backlog (not refused) until uvicorn serves them
    return sock


def check_port_free(host: str, port: int, what: str, flag: str) -> None:
    """PortInUseError when host:port cannot be bound now (for ports a child process binds later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortInUseError(f"cannot listen on {host}:{port} for {what}: {exc.strerror}; another process "
                                 f"holds it (stop it or choose another {flag})") from None
