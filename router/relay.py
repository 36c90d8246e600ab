"""Relaying an instance's response to the client: SSE chunk by chunk, or a whole JSON body."""
import json
import logging
from contextlib import aclosing
from typing import AsyncIterator, Callable

import anyio
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.connectors.stages import stamp
from tandem.router.errors import RouterError, error_body
from tandem.router.upstream import UpstreamStream

logger = logging.getLogger(__name__)

OnClose = Callable[[RouterError | None], None]


def sse_error_event(error: RouterError) -> bytes:
    """What a stream that broke after it started ends with (as vLLM does): an error event, then [DONE]."""
    return f"data: {json.dumps(error_body(error.message, error.status, error.code))}\n\ndata: [DONE]\n\n".encode()


class RelayResponse(StreamingResponse):
    """Relays an instance's SSE stream to the client chunk by chunk, bytes unchanged.

    The upstream is closed when the stream ends, breaks, or the client disconnects
    (Starlette cancels the stream), so the instance sees the disconnect and aborts.
    `on_close(error)` runs once at the end; error is None when the stream completed.
    """

    def __init__(self, upstream: UpstreamStream, on_close: OnClose, upstreams: list[UpstreamStream] | None = None,
                 request_id: str = ""):
        self._upstream, self._request_id = upstream, request_id
        self._upstreams = upstreams or [upstream]  # all closed at the end (a merged relay has several)
        self._on_close = on_close
        self._error: RouterError | None = None
        self._completed = False
        super().__init__(self._chunks(), status_code=upstream.status_code, media_type=upstream.content_type)

    async def relayed(self) -> AsyncIterator[bytes]:
        """The bytes to send the client (subclasses transform them); raises RouterError when broken."""
        async for chunk in self._upstream.aiter_chunks():
            yield chunk

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            first = True
            async with aclosing(self.relayed()) as chunks:  # closed at once when the client leaves
                async for chunk in chunks:
                    if first:
                        stamp(logger, "router", "first_chunk", self._request_id)
                        first = False
                    yield chunk
        except RouterError as e:
            logger.warning("stream from instance %s broke: %s", self._upstream.instance.instance_id, e.message)
            self._error = e
            yield sse_error_event(e)
        self._completed = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                for upstream in self._upstreams:
                    await upstream.aclose()
            if not self._completed and self._error is None:
                logger.info("client left during the stream from instance %s; upstream request closed",
                            self._upstream.instance.instance_id)
                self._error = RouterError("client disconnected", 499, "client_disconnected")
            self._on_close(self._error)


async def relay(upstream: UpstreamStream, client_streams: bool, on_close: OnClose, request_id: str = "") -> Response:
    """The client's response for an open upstream response: a RelayResponse (which calls on_close
    when it ends) when the client asked for a stream and the instance sends SSE, else the body read
    whole (on_close is then the caller's to run)."""
    if client_streams and upstream.is_event_stream:
        return RelayResponse(upstream, on_close, request_id=request_id)
    try:
        content = await upstream.aread()
    finally:
        await upstream.aclose()
    return Response(content, status_code=upstream.status_code, media_type=upstream.content_type)
