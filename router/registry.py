"""InstanceRegistry: the router's live view of prefill/decode/collocated instances.

Instances push pings (server/registry_protocol.py) to a ZMQ PULL socket. A new instance is
admitted only after `GET {http_address}/health` answers 200; one that fails is
not added and is checked again at its next ping. Each ping refreshes the load and
the liveness; an instance silent for `instance_timeout_s` is dropped. An instance
the router could not connect to is marked unhealthy (not routed to) until a later
ping's health check passes again.
"""
import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from tandem.connectors.protocol import PeerGone, encoder
from tandem.router.config import RouterConfig
from tandem.router.metrics import RouterMetrics
from tandem.server.registry_protocol import ROLES, LoadReport, RegisterMessage, UnregisterMessage, decode_message

logger = logging.getLogger(__name__)


@dataclass
class Instance:
    """One registered instance: its latest ping plus the router's own bookkeeping."""

    info: RegisterMessage
    last_seen: float  # time.monotonic() of the latest ping
    healthy: bool = True
    unhealthy_reason: str | None = None
    num_inflight: int = 0  # requests the router has open to it right now

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def url(self) -> str:
        return self.info.http_address.rstrip("/")

    @property
    def load(self) -> LoadReport:
        return self.info.load

    @property
    def num_pending(self) -> int:
        return self.load.num_running + self.load.num_waiting + self.num_inflight

    def to_json(self, now: float) -> dict:
        data = msgspec.to_builtins(self.info)
        data.pop("type", None)
        data.update(healthy=self.healthy, unhealthy_reason=self.unhealthy_reason,
                    num_inflight=self.num_inflight, seconds_since_ping=round(now - self.last_seen, 3))
        return data


class InstanceRegistry:
    def __init__(self, config: RouterConfig, client: aiohttp.ClientSession, metrics: RouterMetrics | None = None):
        self.config = config
        self._client = client
        self._metrics = metrics
        self._instances: dict[str, Instance] = {}
        self._admissions: dict[str, asyncio.Task] = {}  # health checks under way, by instance id
        # instance id -> (last health-check failure, when): a repeated failure is logged once
        self._failed_checks: dict[str, tuple[str, float]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._kv_ctx: zmq.Context | None = None  # DEALER sockets telling prefills of dropped decodes
        self._kv_socks: dict[str, zmq.Socket] = {}
        self.address = ""

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the registry socket (raises zmq.ZMQError if the port is taken) and start listening."""
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self.config.registry_port or "*"
        try:
            self._sock.bind(f"tcp://{self.config.registry_host}:{port}")
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            self._sock = self._ctx = None
            raise RuntimeError(
                f"router registry cannot bind tcp://{self.config.registry_host}:{port}: {e}; "
                "choose another --registry-port") from e
        self.address = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        logger.info("registry listening on %s", self.address)
        self._tasks = [asyncio.create_task(self._receive_loop(), name="registry-receive"),
                       asyncio.create_task(self._sweep_loop(), name="registry-sweep")]

    async def stop(self) -> None:
        for task in [*self._tasks, *self._admissions.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._admissions.values(), return_exceptions=True)
        self._tasks.clear()
        self._admissions.clear()
        if self._sock is not None:
            self._sock.close()
            self._ctx.term()
            self._sock = None
        for sock in self._kv_socks.values():
            sock.close()
        if self._kv_ctx is not None:
            self._kv_ctx.term()
            self._kv_ctx, self._kv_socks = None, {}

    async def _receive_loop(self) -> None:
        while True:
            data = await self._sock.recv()
            try:
                msg = decode_message(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.warning("registry: dropped a malformed message (%d bytes): %s", len(data), e)
                continue
            try:
                self.handle(msg)
            except Exception:
                # A bug on one message must not stop the registry from hearing every other ping.
                logger.exception("registry: failed to handle %r", msg)

    async def _sweep_loop(self) -> None:
        period = min(self.config.ping_interval_s, self.config.instance_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep(time.monotonic())

    # ---- messages --------------------------------------------------------------------------

    def handle(self, msg: RegisterMessage | UnregisterMessage) -> None:
        if isinstance(msg, UnregisterMessage):
            self._unregister(msg.instance_id)
            return
        now = time.monotonic()
        inst = self._instances.get(msg.instance_id)
        if inst is not None and inst.info.static_info() != msg.static_info():
            logger.info("instance %s re-registered with new info (%s at %s); checking it again",
                        msg.instance_id, msg.role, msg.http_address)
            self._remove(msg.instance_id)
            inst = None
        if inst is not None:
            inst.info = msg
            inst.last_seen = now
            if not inst.healthy:
                self._admit_later(msg)
        else:
            self._admit_later(msg)

    def _admit_later(self, msg: RegisterMessage) -> None:
        if msg.instance_id not in self._admissions:
            task = asyncio.create_task(self._admit(msg), name=f"admit-{msg.instance_id}")
            self._admissions[msg.instance_id] = task
            task.add_done_callback(lambda t, i=msg.instance_id: self._admission_done(i, t))

    def _admission_done(self, instance_id: str, task: asyncio.Task) -> None:
        if self._admissions.get(instance_id) is task:
            del self._admissions[instance_id]

    async def _admit(self, msg: RegisterMessage) -> None:
        failure = await self._check_health(msg.http_address)
        now = time.monotonic()
        inst = self._instances.get(msg.instance_id)
        if failure is not None:
            if self._failed_checks.get(msg.instance_id, ("", 0.0))[0] != failure:
                logger.warning("instance %s (%s at %s) failed its health check: %s; not routed to, "
                               "checking again at its next ping", msg.instance_id, msg.role,
                               msg.http_address, failure)
            self._failed_checks[msg.instance_id] = (failure, now)
            if inst is not None:
                inst.unhealthy_reason = failure
            return
        self._failed_checks.pop(msg.instance_id, None)
        if inst is not None:
            inst.healthy, inst.unhealthy_reason, inst.last_seen = True, None, now
            logger.info("instance %s (%s at %s) is healthy again", msg.instance_id, msg.role, msg.http_address)
        else:
            self._instances[msg.instance_id] = Instance(info=msg, last_seen=now)
            logger.info("instance %s registered: role=%s http=%s engine_id=%s kv=%s:%d/%d tp=%d dp=%d",
                        msg.instance_id, msg.role, msg.http_address, msg.engine_id, msg.kv_host,
                        msg.kv_handshake_port, msg.kv_notify_port, msg.tp_size, msg.dp_size)
        self._update_gauge()

    async def _check_health(self, http_address: str) -> str | None:
        """None when /health answers 200, else what went wrong."""
        url = http_address.rstrip("/") + "/health"
        timeout = aiohttp.ClientTimeout(total=self.config.health_check_timeout_s)
        try:
            async with self._client.get(url, timeout=timeout) as resp:
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return f"GET {url} failed: {type(e).__name__}: {e}"
        if status != 200:
            return f"GET {url} answered HTTP {status}"
        return None

    def _unregister(self, instance_id: str) -> None:
        task = self._admissions.pop(instance_id, None)
        if task is not None:
            task.cancel()
        self._failed_checks.pop(instance_id, None)
        if self._remove(instance_id) is not None:
            logger.info("instance %s unregistered", instance_id)

    def _remove(self, instance_id: str) -> Instance | None:
        inst = self._instances.pop(instance_id, None)
        self._update_gauge()
        return inst

    def sweep(self, now: float) -> None:
        """Drop instances whose latest ping is older than the instance timeout."""
        timeout = self.config.instance_timeout_s
        for inst in [i for i in self._instances.values() if now - i.last_seen > timeout]:
            logger.warning("instance %s (%s at %s) dropped: no ping for %.1f s (timeout %.1f s)",
                           inst.instance_id, inst.role, inst.url, now - inst.last_seen, timeout)
            self._remove(inst.instance_id)
            if inst.role == "decode":
                self._tell_prefills_gone(inst)
        for instance_id, (_, when) in list(self._failed_checks.items()):
            if now - when > timeout:
                del self._failed_checks[instance_id]

    def _tell_prefills_gone(self, decode: Instance) -> None:
        """A decode that stopped pinging may still hold its connections open (hung, not dead):
        tell every prefill's KV connector, so it frees the blocks it holds for that decode now."""
        info = decode.info
        if not info.kv_host or not info.kv_handshake_port:
            return
        frame = encoder.encode(PeerGone(f"{info.kv_host}:{info.kv_handshake_port}"))
        for inst in self._instances.values():
            if inst.role != "prefill" or not inst.info.kv_host or not inst.info.kv_handshake_port:
                continue
            address = f"tcp://{inst.info.kv_host}:{inst.info.kv_handshake_port}"
            if self._kv_ctx is None:
                self._kv_ctx = zmq.Context()
            sock = self._kv_socks.get(address)
            if sock is None:
                sock = self._kv_socks[address] = self._kv_ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("could not tell prefill %s that decode %s is gone", inst.instance_id, decode.instance_id)

    # ---- queries ---------------------------------------------------------------------------

    def routable(self, role: str) -> list[Instance]:
        """Healthy instances of `role` whose latest ping is within the instance timeout."""
        now = time.monotonic()
        return [i for i in self._instances.values()
                if i.role == role and i.healthy and now - i.last_seen <= self.config.instance_timeout_s]

    def mark_unhealthy(self, inst: Instance, reason: str) -> None:
        """Stop routing to `inst` until a later ping's health check passes."""
        if inst.healthy and self._instances.get(inst.instance_id) is inst:
            inst.healthy, inst.unhealthy_reason = False, reason
            logger.warning("instance %s (%s at %s) marked unhealthy: %s", inst.instance_id, inst.role,
                           inst.url, reason)
            self._update_gauge()

    def snapshot(self) -> list[dict]:
        now = time.monotonic()
        return [inst.to_json(now) for inst in sorted(self._instances.values(), key=lambda i: i.instance_id)]

    def _update_gauge(self) -> None:
        if self._metrics is None:
            return
        for role in ROLES:
            self._metrics.instances.labels(role).set(
                sum(1 for i in self._instances.values() if i.role == role and i.healthy))
