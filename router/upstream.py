"""Upstream: the router's HTTP calls to instances, over one shared httpx.AsyncClient.

Every call has timeouts (connect: `connect_timeout_s`; between bytes:
`request_timeout_s`). Failures become RouterErrors the client can read: an
instance that cannot be connected to is marked unhealthy at once (502), a silent
one times out (504), an error status is passed through (UpstreamHTTPError).
"""
from typing import AsyncIterator, Callable

import anyio
import httpx

from tandem.router.errors import RouterError, UpstreamHTTPError
from tandem.router.metrics import RouterMetrics
from tandem.router.registry import Instance, InstanceRegistry


def make_http_client(connect_timeout_s: float, request_timeout_s: float) -> httpx.AsyncClient:
    """The one client all upstream calls share (connection pooling, no per-request setup)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s),
        # idle connections close well before an instance's uvicorn drops them (its keep-alive is 5 s):
        # reusing one it is closing fails the request with a ReadError
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=2.0),
        trust_env=False,  # no proxy from the environment between the router and its instances
        headers={"Accept-Encoding": "identity"},  # raw bytes are relayed as they come: no compression
    )


class UpstreamStream:
    """An open (streaming) response from an instance. `aclose()` ends it (the instance sees the
    disconnect and aborts the request if it was not done) and frees the in-flight slot."""

    def __init__(self, instance: Instance, response: httpx.Response,
                 failure: Callable[[Instance, httpx.HTTPError], RouterError]):
        self.instance = instance
        self.response = response
        self._failure = failure
        self._closed = False

    @property
    def status_code(self) -> int:
        return self.response.status_code

    @property
    def content_type(self) -> str:
        return self.response.headers.get("content-type", "application/json")

    @property
    def is_event_stream(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    async def aiter_chunks(self) -> AsyncIterator[bytes]:
        """The body as the instance sent it, chunk by chunk; a transport failure raises RouterError."""
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            raise self._failure(self.instance, e) from e

    async def aread(self) -> bytes:
        try:
            return await self.response.aread()
        except httpx.HTTPError as e:
            raise self._failure(self.instance, e) from e

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.instance.num_inflight -= 1
        with anyio.CancelScope(shield=True):  # close even while the caller is being cancelled
            await self.response.aclose()


class Upstream:
    def __init__(self, client: httpx.AsyncClient, registry: InstanceRegistry, metrics: RouterMetrics):
        self.client = client
        self.registry = registry
        self.metrics = metrics

    async def post_json(self, inst: Instance, path: str, body: dict, headers: dict[str, str]) -> dict:
        """POST `body` and return the instance's JSON object answer."""
        self._count(inst)
        inst.num_inflight += 1
        try:
            resp = await self.client.post(inst.url + path, json=body, headers=headers)
        except httpx.HTTPError as e:
            raise self.failure(inst, e) from e
        finally:
            inst.num_inflight -= 1
        if resp.status_code >= 400:
            self._count_failure(inst)
            raise UpstreamHTTPError(inst.instance_id, resp.status_code, resp.content,
                                    resp.headers.get("content-type"))
        try:
            data = resp.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            self._count_failure(inst)
            raise RouterError(f"{inst.role} instance {inst.instance_id} at {inst.url} answered {path} with "
                              f"something other than a JSON object: {resp.text[:200]!r}", 502, "upstream_bad_response")
        return data

    async def open_stream(self, inst: Instance, path: str, body: dict | bytes,
                          headers: dict[str, str]) -> UpstreamStream:
        """POST and return once the response headers arrived; the body is read by the caller.

        `body` is a dict (sent as JSON) or the client's raw bytes (sent unchanged).
        Raises UpstreamHTTPError (with the body read) when the status is an error.
        """
        self._count(inst)
        if isinstance(body, bytes):
            request = self.client.build_request("POST", inst.url + path, content=body,
                                                headers={**headers, "Content-Type": "application/json"})
        else:
            request = self.client.build_request("POST", inst.url + path, json=body, headers=headers)
        inst.num_inflight += 1
        try:
            response = await self.client.send(request, stream=True)
        except BaseException as e:
            inst.num_inflight -= 1
            if isinstance(e, httpx.HTTPError):
                raise self.failure(inst, e) from e
            raise
        stream = UpstreamStream(inst, response, self.failure)
        if response.status_code >= 400:
            try:
                content = await response.aread()
            except httpx.HTTPError as e:
                raise self.failure(inst, e) from e
            finally:
                await stream.aclose()
            self._count_failure(inst)
            raise UpstreamHTTPError(inst.instance_id, response.status_code, content,
                                    response.headers.get("content-type"))
        return stream

    async def get_json(self, inst: Instance, path: str) -> dict:
        key = self.registry.config.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None  # instances accept the router's key
        try:
            resp = await self.client.get(inst.url + path, headers=headers,
                                         timeout=self.registry.config.health_check_timeout_s)
        except httpx.HTTPError as e:
            raise self.failure(inst, e) from e
        if resp.status_code != 200:
            raise UpstreamHTTPError(inst.instance_id, resp.status_code, resp.content, resp.headers.get("content-type"))
        return resp.json()

    def failure(self, inst: Instance, exc: httpx.HTTPError) -> RouterError:
        """Map a transport failure to the client's error; an unreachable instance stops being routed to."""
        self._count_failure(inst)
        where = f"{inst.role} instance {inst.instance_id} at {inst.url}"
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            self.registry.mark_unhealthy(inst, f"connect failed: {type(exc).__name__}: {exc}")
            error = RouterError(f"cannot connect to {where}: {type(exc).__name__}: {exc}", 502, "upstream_unreachable")
        elif isinstance(exc, httpx.TimeoutException):
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
