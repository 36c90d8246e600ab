"""A KV agent: a ZMQ server thread answering peers and a client thread doing this side's own
sends, requests and handshakes in order, with one cached DEALER socket per peer.

The scheduler side runs one (control: handshakes, block ids, notifications) and every rank
runs one (data: block reads and writes). Sockets are used by their owning thread only.
A peer can be watched: its connection failing (refused, or dropped because the process died)
calls back at once instead of waiting for a timeout.
"""
import logging
import queue
import threading
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from tandem.connectors.protocol import Hello, HelloReply, decoder, encoder

logger = logging.getLogger(__name__)

Handler = Callable[[object, memoryview | None], "tuple[object, bytes | None] | None"]
_DEAD_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class TransferError(Exception):
    pass


class KVAgent:
    def __init__(self, name: str, host: str, port: int, timeout_s: float, handle: Handler):
        """handle(msg, payload) runs on the server thread; what it returns is sent back."""
        self.name, self.handle = name, handle
        self.timeout_ms = int(timeout_s * 1000)
        self.ctx = zmq.Context()
        self.server = self.ctx.socket(zmq.ROUTER)
        self.server.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self.server.bind(f"tcp://{host}:{port}")
            else:  # asked for: a free port
                port = self.server.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self.server.close()
            self.ctx.term()
            raise OSError(f"{name}: cannot listen on {host}:{port}: {e}; another process holds it (choose other "
                          f"ports: --kv-port, --base-port or the port lists)") from None
        self.address = f"{host}:{port}"
        self.jobs: queue.Queue = queue.Queue()
        self.sockets: dict[str, zmq.Socket] = {}
        self.hellos: dict[str, HelloReply] = {}
        self.watches: dict[str, tuple[zmq.Socket, Callable[[str], None]]] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-server", daemon=True),
                         threading.Thread(target=self._work, name=f"{name}-client", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- server thread ------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.server, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, header, *payload = self.server.recv_multipart(copy=False)
            try:
                answer = self.handle(decoder.decode(header.buffer), payload[0].buffer if payload else None)
            except Exception:  # a bad peer message must not kill the agent
                logger.exception("%s: failed to handle a message from a peer", self.name)
                continue
            if answer is not None:
                reply, data = answer
                self.server.send_multipart([ident, encoder.encode(reply)] + ([data] if data is not None else []),
                                           copy=False)

    # ---- client thread ------------------------------------------------------------------

    def submit(self, fn: Callable[[], None]) -> None:
        """Run fn on the client thread (the only one that may call the methods below)."""
        self.jobs.put(fn)

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                fn = self.jobs.get(timeout=0.05)
            except queue.Empty:
                fn = None
            if fn is not None:
                try:
                    fn()
                except Exception:
                    logger.exception("%s: job failed", self.name)
            self._check_watches()

    def socket(self, peer: str) -> zmq.Socket:
        sock = self.sockets.get(peer)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            self.sockets[peer] = sock
            sock.connect(f"tcp://{peer}")
        return sock

    def hello(self, peer: str, msg: Hello) -> tuple[HelloReply, bool]:
        """Handshake with peer once (cached): (its reply, whether it is new). Raises TransferError
        when the peer does not answer or refuses."""
        if peer in self.hellos:
            return self.hellos[peer], False
        reply, _ = self.request(peer, msg)
        if reply.error:
            raise TransferError(f"KV handshake with {reply.engine_id} at {peer} refused: {reply.error}")
        self.hellos[peer] = reply
        return reply, True

    def request(self, peer: str, msg) -> tuple[object, memoryview | None]:
        """Send msg and wait for the answer: (reply, payload or None)."""
        sock = self.socket(peer)
        sock.send_multipart([encoder.encode(msg)])
        if not sock.poll(self.timeout_ms):
            self.forget(peer)  # the socket may hold a late reply; start the next session clean
            raise TransferError(f"no answer from the KV agent at {peer} within {self.timeout_ms / 1000:.1f} s")
        frames = sock.recv_multipart(copy=False)
        return decoder.decode(frames[0].buffer), (frames[1].buffer if len(frames) > 1 else None)

    def send(self, peer: str, msg, payload=None) -> None:
        """Fire and forget (ZMQ keeps order per peer)."""
        self.socket(peer).send_multipart([encoder.encode(msg)] + ([payload] if payload is not None else []),
                                         copy=False)

    def forget(self, peer: str) -> None:
        self.hellos.pop(peer, None)
        sock = self.sockets.pop(peer, None)
        if sock is not None:
            sock.close()

    def watch(self, peer: str, on_dead: Callable[[str], None]) -> None:
        """Call on_dead(peer) (client thread) once the connection to peer fails: refused, or
        dropped because the peer process died."""
        if peer in self.watches:
            self.watches[peer] = (self.watches[peer][0], on_dead)
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | _DEAD_EVENTS)
        sock.connect(f"tcp://{peer}")
        self.watches[peer] = (monitor, on_dead)
        self.sockets.setdefault(f"watch:{peer}", sock)

    def unwatch(self, peer: str) -> None:
        entry = self.watches.pop(peer, None)
        if entry is not None:
            entry[0].close()
            sock = self.sockets.pop(f"watch:{peer}", None)
            if sock is not None:
                sock.close()

    def _check_watches(self) -> None:
        for peer, (monitor, on_dead) in list(self.watches.items()):
            while monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                if event & _DEAD_EVENTS:
                    logger.warning("%s: the KV peer at %s is gone", self.name, peer)
                    self.unwatch(peer)
                    self.forget(peer)
                    on_dead(peer)
                    break

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        for peer in list(self.watches):
            self.unwatch(peer)
        for sock in self.sockets.values():
            sock.close()
        self.server.close()
        self.ctx.term()
