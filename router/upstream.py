"""Upstream: the router's HTTP calls to instances, over one shared aiohttp.ClientSession.

aiohttp rather than httpx: its C HTTP parser and single-write requests cut the router -> instance
hop (benchmarks/router_hop.py: 0.62 -> 0.39 ms for a 2000-token completions body on a CPU).
Every call has timeouts (connect: `connect_timeout_s`; between bytes: `request_timeout_s`).
Failures become RouterErrors the client can read: an instance that cannot be connected to is
marked unhealthy at once (502), a silent one times out (504), an error status is passed through
(UpstreamHTTPError).
"""
import asyncio
import json
from typing import AsyncIterator, Callable

import aiohttp
import anyio

from tandem.router.errors import RouterError, UpstreamHTTPError
from tandem.router.metrics import RouterMetrics
from tandem.router.registry import Instance, InstanceRegistry

# What a failed call raises: aiohttp's errors, and asyncio's TimeoutError for a total timeout.
TransportError = (aiohttp.ClientError, asyncio.TimeoutError)


def make_http_client(connect_timeout_s: float, request_timeout_s: float) -> aiohttp.ClientSession:
    """The one client all upstream calls share (connection pooling, no per-request setup)."""
    connector = aiohttp.TCPConnector(
        limit=0,  # no pool bound: the router's concurrency is its clients'
        # idle connections close well before an instance's uvicorn drops them (its keep-alive is 5 s):
        # reusing one it is closing fails the request
        keepalive_timeout=2.0)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=request_timeout_s),
        trust_env=False,  # no proxy from the environment between the router and its instances
        auto_decompress=False,  # raw bytes are relayed as they come: no compression
        headers={"Accept-Encoding": "identity"})


class UpstreamStream:
    """An open (streaming) response from an instance. `aclose()` ends it (the instance sees the
    disconnect and aborts the request if it was not done) and frees the in-flight slot."""

    def __init__(self, instance: Instance, response: aiohttp.ClientResponse,
                 failure: Callable[[Instance, Exception], RouterError]):
        self.instance = instance
        self.response = response
        self._failure = failure
        self._closed = False
        self._read_ahead: list[bytes] = []  # read by peek(), relayed first
        self.head = b""  # what peek() returned
        self._companions: list[asyncio.Task] = []  # calls that end with this response (close_with)

    @property
    def status_code(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str:
        return self.response.headers.get("content-type", "application/json")

    @property
    def is_event_stream(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    async def next_chunk(self) -> bytes:
        """The next bytes of the body as they arrived; b"" at its end. A transport failure raises RouterError."""
        if self._read_ahead:
            return self._read_ahead.pop(0)
        try:
            return await self.response.content.readany()
        except TransportError as e:
            raise self._failure(self.instance, e) from e

    async def aiter_chunks(self) -> AsyncIterator[bytes]:
        """The (rest of the) body as the instance sent it, chunk by chunk."""
        while chunk := await self.next_chunk():
            yield chunk

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_chunks()])

    async def peek(self) -> bytes:
        """The body's first bytes: up to the end of its first SSE event for an event stream, else its
        first chunk (b"" when the body is empty), also kept as `head`. They stay to be read again
        (next_chunk, aread)."""
        assert not self._read_ahead, "peek() is called once, before the body is read"
        while True:
            chunk = await self.next_chunk()
            if not chunk:
                break
            self._read_ahead.append(chunk)
            self.head += chunk
            if not self.is_event_stream or b"\n\n" in self.head.replace(b"\r\n", b"\n"):
                break
        return self.head

    def close_with(self, task: asyncio.Task) -> None:
        """Let `task`, a call this response no longer waits for, end with it: aclose() awaits it when
        the body was read to its end, and cancels it first when not (the client left, the stream broke)."""
        self._companions.append(task)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.instance.num_inflight -= 1
        complete = self.response.content.is_eof() and not self._read_ahead
        if complete:
            self.response.release()  # read to the end: the connection goes back to the pool
        else:
            self.response.close()  # the instance sees the disconnect
        if not complete:
            for task in self._companions:
                task.cancel()
        if self._companions:
            with anyio.CancelScope(shield=True):  # awaited even while the caller is being cancelled
                await asyncio.gather(*self._companions, return_exceptions=True)


class Upstream:
    def __init__(self, client: aiohttp.ClientSession, registry: InstanceRegistry, metrics: RouterMetrics):
        self.client = client
        self.registry = registry
        self.metrics = metrics

    async def post_json(self, inst: Instance, path: str, body: dict, headers: dict[str, str]) -> dict:
        """POST `body` and return the instance's JSON object answer."""
        self._count(inst)
        inst.num_inflight += 1
        try:
            async with self.client.post(inst.url + path, data=json.dumps(body).encode(),
                                        headers={**headers, "Content-Type": "application/json"}) as resp:
                status, content_type, content = resp.status, resp.headers.get("content-type"), await resp.read()
        except TransportError as e:
            raise self.failure(inst, e) from e
        finally:
            inst.num_inflight -= 1
        if status >= 400:
            self._count_failure(inst)
            raise UpstreamHTTPError(inst.instance_id, status, content, content_type)
        try:
            data = json.loads(content)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            self._count_failure(inst)
            raise RouterError(f"{inst.role} instance {inst.instance_id} at {inst.url} answered {path} with "
                              f"something other than a JSON object: {content[:200]!r}", 502, "upstream_bad_response")
        return data

    async def open_stream(self, inst: Instance, path: str, body: dict | bytes,
                          headers: dict[str, str]) -> UpstreamStream:
        """POST and return once the response headers arrived; the body is read by the caller.

        `body` is a dict (sent as JSON) or the client's raw bytes (sent unchanged).
        Raises UpstreamHTTPError (with the body read) when the status is an error.
        """
        self._count(inst)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        inst.num_inflight += 1
        try:
            response = await self.client.post(inst.url + path, data=data,
                                              headers={**headers, "Content-Type": "application/json"})
        except BaseException as e:
            inst.num_inflight -= 1
            if isinstance(e, TransportError):
                raise self.failure(inst, e) from e
            raise
        stream = UpstreamStream(inst, response, self.failure)
        if response.status >= 400:
            try:
                content = await stream.aread()
            finally:
                await stream.aclose()
            self._count_failure(inst)
            raise UpstreamHTTPError(inst.instance_id, response.status, content, response.headers.get("content-type"))
        return stream

    async def get_json(self, inst: Instance, path: str) -> dict:
        key = self.registry.config.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None  # instances accept the router's key
        timeout = aiohttp.ClientTimeout(total=self.registry.config.health_check_timeout_s)
        try:
            async with self.client.get(inst.url + path, headers=headers, timeout=timeout) as resp:
                status, content_type, content = resp.status, resp.headers.get("content-type"), await resp.read()
        except TransportError as e:
            raise self.failure(inst, e) from e
        if status != 200:
            raise UpstreamHTTPError(inst.instance_id, status, content, content_type)
        return json.loads(content)

    def failure(self, inst: Instance, exc: Exception) -> RouterError:
        """Map a transport failure to the client's error; an unreachable instance stops being routed to."""
        self._count_failure(inst)
        where = f"{inst.role} instance {inst.instance_id} at {inst.url}"
        if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
            self.registry.mark_unhealthy(inst, f"connect failed: {type(exc).__name__}: {exc}")
            error = RouterError(f"cannot connect to {where}: {type(exc).__name__}: {exc}", 502, "upstream_unreachable")
        elif isinstance(exc, asyncio.TimeoutError):
            limit = self.registry.config.request_timeout_s
            error = RouterError(f"{where} did not answer in time ({type(exc).__name__}; --request-timeout "
                                f"{limit:g} s)", 504, "upstream_timeout")
        else:
            error = RouterError(f"{where} failed: {type(exc).__name__}: {exc}", 502, "upstream_error")
        return error

    def _count(self, inst: Instance) -> None:
        self.metrics.instance_requests.labels(inst.instance_id, inst.role).inc()

    def _count_failure(self, inst: Instance) -> None:
        self.metrics.instance_failures.labels(inst.instance_id, inst.role).inc()
