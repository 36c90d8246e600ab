"""The KV agent of one instance: a ZMQ server thread answering peers (handshake, block
reads, block writes, notifications) and a client thread doing this instance's own
transfers in order, with one cached session (DEALER socket + checked layout) per peer.

Both threads touch the KV cache only in blocks that the scheduler has handed to a
transfer (held after finish on the prefill side, WAITING_FOR_REMOTE_KVS on the decode
side), so they never race the model.
"""
import logging
import queue
import threading
from typing import Callable

import torch
import zmq

from tandem.connectors.protocol import (BlocksData, Handshake, HandshakeReply, KVLayout, ReadBlocks, WriteBlocks, decoder,
                                 encoder)
from tandem.connectors.staging import gather_blocks, scatter_blocks

logger = logging.getLogger(__name__)


class TransferError(Exception):
    pass


class KVAgent:
    def __init__(self, engine_id: str, kv_cache: torch.Tensor, layout: KVLayout, host: str, port: int,
                 timeout_s: float, on_message: Callable[[object], None]):
        """on_message receives FreeBlocks / DecodeBlocks / TransferDone from peers (server thread)."""
        self.engine_id, self.kv_cache, self.layout = engine_id, kv_cache, layout
        self.transport = None  # set by the connector before any transfer
        self.timeout_ms = int(timeout_s * 1000)
        self.on_message = on_message
        self.ctx = zmq.Context()
        self.server = self.ctx.socket(zmq.ROUTER)
        self.server.setsockopt(zmq.LINGER, 0)
        if port:
            self.server.bind(f"tcp://{host}:{port}")
        else:
            port = self.server.bind_to_random_port(f"tcp://{host}")
        self.address = f"{host}:{port}"
        self.jobs: queue.Queue = queue.Queue()
        self.sessions: dict[str, zmq.Socket] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, name="kv-agent-server", daemon=True),
                         threading.Thread(target=self._work, name="kv-agent-client", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- server side: requests from peers ----------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.server, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, header, *payload = self.server.recv_multipart(copy=False)
            try:
                self._handle(ident.bytes, decoder.decode(header.buffer), payload)
            except Exception:  # a bad peer message must not kill the agent
                logger.exception("KV agent: failed to handle a message from a peer")

    def _reply(self, ident: bytes, msg, payload: bytes | None = None) -> None:
        frames = [ident, encoder.encode(msg)] + ([payload] if payload is not None else [])
        self.server.send_multipart(frames, copy=False)

    def _handle(self, ident: bytes, msg, payload) -> None:
        if isinstance(msg, Handshake):
            error = self.layout.mismatch(msg.layout)
            if msg.transport != self.transport.name:
                error = f"KV transports differ ({msg.transport} vs {self.transport.name})"
            if error:
                logger.error("refused KV handshake from %s: %s", msg.engine_id, error)
            self._reply(ident, HandshakeReply(self.engine_id, self.layout, error, self.transport.name,
                                              b"" if error else self.transport.local_info()))
        elif isinstance(msg, ReadBlocks):
            try:
                data = gather_blocks(self.kv_cache, msg.block_ids)
            except (IndexError, RuntimeError) as e:
                self._reply(ident, BlocksData(msg.request_id, error=f"bad block ids: {e}"))
                return
            self._reply(ident, BlocksData(msg.request_id), data)
        elif isinstance(msg, WriteBlocks):
            self.on_message(msg, payload[0].buffer)
        else:
            self.on_message(msg, None)

    # ---- client side: this instance's transfers, in order ------------------------------

    def submit(self, fn: Callable[[], None]) -> None:
        """Run fn on the client thread (it may call read_blocks / send)."""
        self.jobs.put(fn)

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                fn = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                fn()
            except Exception:
                logger.exception("KV agent: transfer job failed")

    def session(self, peer: str) -> zmq.Socket:
        """A DEALER socket to peer whose layout has been checked (handshake once, cached)."""
        sock = self.sessions.get(peer)
        if sock is not None:
            return sock
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{peer}")
        sock.send_multipart([encoder.encode(Handshake(self.engine_id, self.layout, self.transport.name))])
        try:
            reply = self._recv(sock, peer)
        except TransferError:
            sock.close()
            raise
        if reply.error:
            sock.close()
            raise TransferError(f"KV handshake with {reply.engine_id} at {peer} refused: {reply.error}")
        try:
            self.transport.attach(peer, reply.transport_info)
        except Exception as e:
            sock.close()
            raise TransferError(f"cannot attach to the KV cache of {reply.engine_id} at {peer}: {e}") from e
        self.sessions[peer] = sock
        logger.info("KV session with %s at %s", reply.engine_id, peer)
        return sock

    def _recv(self, sock: zmq.Socket, peer: str):
        if not sock.poll(self.timeout_ms):
            # The socket may hold a late reply; drop it so the next session starts clean.
            self.sessions.pop(peer, None)
            sock.close()
            raise TransferError(f"no answer from the KV agent at {peer} within {self.timeout_ms / 1000:.1f} s")
        frames = sock.recv_multipart(copy=False)
        msg = decoder.decode(frames[0].buffer)
        return (msg, frames[1].buffer) if len(frames) > 1 else msg

    def read_blocks(self, peer: str, request_id: str, remote_blocks: list[int], local_blocks: list[int]) -> None:
        """Read mode pull: copy peer's remote_blocks into our local_blocks (client thread only)."""
        sock = self.session(peer)
        sock.send_multipart([encoder.encode(ReadBlocks(request_id, remote_blocks))])
        reply = self._recv(sock, peer)
        if not isinstance(reply, tuple):
            raise TransferError(f"KV read of {request_id} from {peer} failed: {reply.error}")
        scatter_blocks(self.kv_cache, local_blocks, reply[1])

    def send(self, peer: str, msg, payload: bytes | None = None) -> None:
        """Fire-and-forget message to peer (client thread only)."""
        sock = self.session(peer)
        sock.send_multipart([encoder.encode(msg)] + ([payload] if payload is not None else []), copy=False)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        for sock in self.sessions.values():
            sock.close()
        self.server.close()
        self.ctx.term()

