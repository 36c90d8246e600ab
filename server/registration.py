"""RegistrationClient: the instance side of the router registry.

A prefill/decode/collocated API server creates one, `start()`s it once its HTTP
server answers /health, and `stop()`s it on shutdown:

    client = RegistrationClient("tcp://router-host:30001", InstanceInfo(...), 1.0, engine_load)
    client.start()
    ...
    client.stop()  # sends "unregister"

A daemon thread pushes a `RegisterMessage` every `interval_s` over ZMQ PUSH. The
socket queues at most a couple of unsent pings (the rest are dropped), so a router
that is down or restarting gets the current state when it comes back, not a backlog.
"""
import logging
import threading
from typing import Callable

import msgspec
import zmq

from tandem.server.registry_protocol import InstanceInfo, LoadReport, RegisterMessage, UnregisterMessage, encode_message

logger = logging.getLogger(__name__)

_UNREGISTER_LINGER_MS = 500  # how long stop() may wait to deliver "unregister"
_MAX_QUEUED_PINGS = 2  # while the router is unreachable


def normalize_router_address(address: str) -> str:
    """'host:port' -> 'tcp://host:port'; full ZMQ endpoints are kept."""
    return address if "://" in address else f"tcp://{address}"


class RegistrationClient:
    """Pings the router every `interval_s` with `info` and the load `load_fn()` returns.

    load_fn returns {"num_running": int, "num_waiting": int, "kv_cache_usage": float};
    it runs on the client's thread, so it must be thread-safe (read counters, don't block).
    """

    def __init__(self, router_address: str, info: InstanceInfo, interval_s: float = 1.0,
                 load_fn: Callable[[], dict] | None = None):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.router_address = normalize_router_address(router_address)
        self.info = info
        self.interval_s = interval_s
        self._load_fn = load_fn
        self._stop_event = threading.Event()
        self._unregister_on_stop = True
        self._load_fn_failed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("RegistrationClient already started")
        self._thread = threading.Thread(target=self._run, name=f"registration-{self.info.instance_id}",
                                        daemon=True)
        self._thread.start()
        logger.info("instance %s (%s) registering with router at %s every %.2f s",
                    self.info.instance_id, self.info.role, self.router_address, self.interval_s)

    def stop(self, timeout_s: float = 2.0, unregister: bool = True) -> None:
        """Stop pinging and send "unregister" (best effort: the router may be gone). With
        unregister=False the instance just falls silent, as a crashed one would."""
        if self._thread is None:
            return
        self._unregister_on_stop = unregister
        self._stop_event.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("registration thread of %s did not stop within %.1f s", self.info.instance_id, timeout_s)
        self._thread = None

    def register_message(self) -> RegisterMessage:
        fields = {f: getattr(self.info, f) for f in InstanceInfo.__struct_fields__}
        return RegisterMessage(**fields, load=self._load())

    def _load(self) -> LoadReport:
        if self._load_fn is None:
            return LoadReport()
        try:
            return msgspec.convert(self._load_fn(), LoadReport)
        except Exception:
            # A broken load report must not stop the liveness pings: report zero load instead.
            if not self._load_fn_failed:
                logger.exception("load_fn of instance %s failed; pinging with zero load (logged once)",
                                 self.info.instance_id)
            self._load_fn_failed = True
            return LoadReport()

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        # Not ZMQ_CONFLATE: closing a conflating socket can drop the last message (our unregister).
        sock.setsockopt(zmq.SNDHWM, _MAX_QUEUED_PINGS)
        sock.setsockopt(zmq.LINGER, _UNREGISTER_LINGER_MS)
        sock.connect(self.router_address)
        try:
            while not self._stop_event.is_set():
                self._send(sock, encode_message(self.register_message()))
                self._stop_event.wait(self.interval_s)
            if self._unregister_on_stop:
                self._send(sock, encode_message(UnregisterMessage(self.info.instance_id)))
        finally:
            sock.close()
            ctx.term()

    def _send(self, sock: zmq.Socket, frame: bytes) -> None:
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("router %s not reachable; ping of %s skipped", self.router_address, self.info.instance_id)
