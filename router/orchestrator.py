"""PDOrchestrator: serves one OpenAI request through a prefill/decode pair (or a collocated instance).

The contract with the instances (their KV connector reads `kv_transfer_params`):

kv_transfer_params is connectors.params.KVTransferParams on both sides.

Read mode (decode pulls), serial (P and D are picked together):
  1. P gets the client's body with max_tokens=1 (chat: also max_completion_tokens=1),
     stream=false, no stream_options, min_tokens at most 1, n=1, and
     kv_transfer_params={"do_remote_decode": true, "remote_*": D's KV address} (P frees its
     held blocks at once if D's connection fails before D read them).
  2. P answers JSON with a top-level "kv_transfer_params" dict (remote_engine_id,
     remote_block_ids, remote_host, remote_port, remote_request_id, first_token_id,
     first_token_logprobs, ...): P computed the whole prompt and sampled the client's first
     token; D emits it as its first output (the client sees it once: P's answer is not relayed). An error
     answer goes back to the client unchanged and D is never contacted.
  3. D gets the client's original body with kv_transfer_params = P's dict; D's
     answer (SSE or JSON) is relayed to the client.

Write mode (prefill pushes), concurrent, one transfer_id = uuid4().hex:
  D gets the original body + kv_transfer_params={"do_remote_prefill": true, "mode": "write",
    "transfer_id", "remote_engine_id": P.engine_id, "remote_host": P.kv_host,
    "remote_port": P.kv_handshake_port, "remote_notify_port": P.kv_notify_port}.
  P gets the prefill body (as in read mode) + kv_transfer_params={"do_remote_decode": true,
    "mode": "write", "transfer_id", "remote_engine_id": D.engine_id, "remote_host": D.kv_host,
    "remote_port": D.kv_handshake_port, "remote_notify_port": D.kv_notify_port}.
  D's output is relayed as soon as D produced some (its first SSE event that is not an error,
  or the start of its JSON answer): D's first token comes from P after P pushed the whole
  prompt's KV, so P's own answer adds nothing. If P fails before that, D is cancelled and the
  client gets P's error; if D fails first, P is cancelled; when D's first event is an error,
  P's answer is awaited as well (P's error wins). P's answer arriving after the relay began is
  awaited when D's response ends (cancelled if the client left); a failure there is logged.

A batched prompt or n > 1 fans out to one transfer per choice (router/fanout.py), merged into one answer.

Both modes send the client's X-Request-Id (or a new one) to P and D and back to the
client, and forward the client's Authorization header. A client that disconnects
closes the upstream requests.
"""
import asyncio
import json
import logging
import time
import uuid
from functools import partial

from fastapi import Request
from starlette.requests import ClientDisconnect
from fastapi.responses import JSONResponse, Response

from tandem.connectors.params import KVTransferParams, parse_kv_transfer_params
from tandem.connectors.stages import stamp
from tandem.router.config import RouterConfig
from tandem.router.errors import RouterError
from tandem.router.fanout import MergedRelayResponse, SubRequest, merge_answers, response_id, split_request
from tandem.router.metrics import RouterMetrics
from tandem.router.policy import make_policy
from tandem.router.registry import Instance, InstanceRegistry
from tandem.router.relay import OnClose, RelayResponse, relay
from tandem.router.upstream import Upstream, UpstreamStream
from tandem.server.disconnect import ClientDisconnected, cancel_on_disconnect
from tandem.server.text_check import find_invalid_text, printable

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"


def prefill_request_body(body: dict, path: str, kv_transfer_params: dict) -> dict:
    """The client's body cut down to a prefill: one token, no streaming, one choice."""
    prefill = dict(body)
    prefill["max_tokens"] = 1
    if path == CHAT_PATH:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    prefill.pop("stream_options", None)
    # The prefill samples the client's first token: it masks EOS/stop tokens as the client's
    # min_tokens asks (min_tokens > 1 would make max_tokens=1 invalid; 1 masks the same).
    if isinstance(prefill.get("min_tokens"), int) and prefill["min_tokens"] >= 1:
        prefill["min_tokens"] = 1
    else:
        prefill.pop("min_tokens", None)
    if "n" in prefill:
        prefill["n"] = 1
    prefill["kv_transfer_params"] = kv_transfer_params
    return prefill


def peer_kv_address(inst: Instance) -> dict:
    """Where the other side of a transfer reaches `inst`'s KV connector."""
    return {"remote_engine_id": inst.info.engine_id, "remote_host": inst.info.kv_host,
            "remote_port": inst.info.kv_handshake_port, "remote_notify_port": inst.info.kv_notify_port}


def kv_params(**fields) -> dict:
    """kv_transfer_params for an instance, checked against the shared structure."""
    return KVTransferParams(**fields).to_dict()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


async def parse_json_body(request: Request) -> tuple[dict, bytes]:
    """The client's JSON object; not JSON (NaN, bad UTF-8, too deep) or not valid Unicode is a 400."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone while sending its body: nobody to answer (logged as 499, not as a bug)
        raise RouterError("client disconnected while sending the request", 499, "client_disconnected") from None
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise RouterError(f"request body is not valid JSON: {printable(str(e))}", 400, "invalid_json") from None
    if not isinstance(body, dict):
        raise RouterError("request body must be a JSON object", 400, "invalid_json")
    bad = find_invalid_text(body)
    if bad is not None:
        raise RouterError(bad, 400, "invalid_request", param=bad.split(":", 1)[0])
    return body, raw


async def _cancel_all(*tasks: asyncio.Task) -> None:
    """Cancel `tasks`; close the upstream streams of those that already opened one."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is None:
            result = task.result()
            if isinstance(result, UpstreamStream):
                await result.aclose()


def has_output(head: bytes, event_stream: bool) -> bool:
    """Whether the first bytes of decode's 200 answer (UpstreamStream.peek) show output: a JSON
    answer began (decode finished), or the first SSE event carries data that is not an error."""
    if not event_stream:
        return bool(head)
    event = head.replace(b"\r\n", b"\n").split(b"\n\n", 1)[0]
    data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    try:
        chunk = json.loads(data)
    except ValueError:  # no data, [DONE], or not JSON
        return False
    return isinstance(chunk, dict) and "error" not in chunk


def _log_late_prefill_failure(request_id: str, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("request %s: prefill failed after decode's output was being relayed (left as it is): %s",
                       request_id, task.exception())


async def _all_or_first_failure(tasks: list[asyncio.Task]) -> None:
    """Wait until every task succeeded; raise the first failure (the earliest in `tasks` among
    those that failed in the same wake-up)."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()


class PDOrchestrator:
    def __init__(self, config: RouterConfig, registry: InstanceRegistry, upstream: Upstream,
                 metrics: RouterMetrics):
        self.config = config
        self.registry = registry
        self.upstream = upstream
        self.metrics = metrics
        self.policy = make_policy(config.routing_policy)

    def pick(self) -> tuple[Instance, Instance | None]:
        """(prefill, decode) when a pair is routable, else (collocated, None); 503 when neither."""
        prefill, decode = self.registry.routable("prefill"), self.registry.routable("decode")
        if prefill and decode:
            return self.policy.choose("prefill", prefill), self.policy.choose("decode", decode)
        collocated = self.registry.routable("collocated")
        if collocated:
            return self.policy.choose("collocated", collocated), None
        if prefill or decode:
            missing = "decode" if prefill else "prefill"
            reason = f"no healthy {missing} instance to pair with the {len(prefill or decode)} " \
                     f"{'prefill' if prefill else 'decode'} instance(s), and no collocated instance"
        else:
            reason = "no healthy instance is registered (need a prefill+decode pair or a collocated instance)"
        raise RouterError(reason, 503, "no_instance")

    async def serve(self, request: Request, path: str) -> Response:
        """Serve one client request to `path` (/v1/completions or /v1/chat/completions)."""
        body, raw = await parse_json_body(request)
        client_streams = bool(body.get("stream", False))
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        stamp(logger, "router", "parsed", request_id)
        headers = {"X-Request-Id": request_id}
        if self.config.api_key:  # instances registered with a keyed router accept the router's key
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        elif "authorization" in request.headers:  # instances that check an API key see the client's
            headers["Authorization"] = request.headers["authorization"]
        try:
            first, decode = self.pick()
        except RouterError as e:
            self.metrics.requests.labels(path, "none").inc()
            self.metrics.failures.labels(path, str(e.status)).inc()
            raise
        target = "collocated" if decode is None else f"pd_{self.config.kv_mode}"
        self.metrics.requests.labels(path, target).inc()
        self.metrics.in_flight.inc()
        finished = False

        def finish(error: RouterError | None) -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            self.metrics.in_flight.dec()
            if error is not None:
                self.metrics.failures.labels(path, str(error.status)).inc()

        subs = split_request(body, path) if decode is not None else None
        if decode is None:
            work = self._collocated(first, path, raw, client_streams, headers, finish)
        elif subs is None:
            work = self._pd(first, decode, path, body, client_streams, headers, finish)
        else:
            work = self._fan_out((first, decode), subs, path, body, client_streams, headers, finish)
        try:
            response = await cancel_on_disconnect(request, work)
        except RouterError as e:
            finish(e)
            raise
        except ClientDisconnected:
            logger.info("request %s: client disconnected before the answer; upstream requests closed", request_id)
            finish(RouterError("client disconnected", 499, "client_disconnected"))
            return Response(status_code=499)
        except BaseException:
            finish(RouterError("internal error", 500))
            raise
        if not isinstance(response, RelayResponse):
            finish(None)
        response.headers["X-Request-Id"] = request_id
        return response

    async def _collocated(self, inst: Instance, path: str, raw: bytes, client_streams: bool,
                          headers: dict[str, str], finish: OnClose) -> Response:
        stream = await self.upstream.open_stream(inst, path, raw, headers)
        return await relay(stream, client_streams, finish, headers["X-Request-Id"])

    async def _prefill(self, inst: Instance, path: str, body: dict, headers: dict[str, str]) -> dict:
        start = time.perf_counter()
        answer = await self.upstream.post_json(inst, path, body, headers)
        self.metrics.prefill_seconds.observe(time.perf_counter() - start)
        stamp(logger, "router", "prefill_answered", headers["X-Request-Id"])
        return answer

    async def _pd(self, prefill: Instance, decode: Instance, path: str, body: dict, client_streams: bool,
                  headers: dict[str, str], finish: OnClose) -> Response:
        stream = await self._open_pd(prefill, decode, path, body, headers)
        return await relay(stream, client_streams, finish, headers["X-Request-Id"])

    async def _open_pd(self, prefill: Instance, decode: Instance, path: str, body: dict,
                       headers: dict[str, str]) -> UpstreamStream:
        """One KV transfer for one choice; returns decode's open response."""
        if self.config.kv_mode == "read":
            return await self._open_read(prefill, decode, path, body, headers)
        return await self._open_write(prefill, decode, path, body, headers)

    async def _fan_out(self, pair: tuple[Instance, Instance], subs: list[SubRequest], path: str, body: dict,
                       client_streams: bool, headers: dict[str, str], finish: OnClose) -> Response:
        """A batched or n > 1 request: one transfer per choice (each pair picked by the policy), all
        opened before anything is relayed; the first failure cancels the rest and is the answer."""
        pairs = [pair] + [self.pick() for _ in subs[1:]]
        opens = [asyncio.create_task(self._open_pd(p, d, path, sub.body, headers)) for (p, d), sub in zip(pairs, subs)]
        try:
            await _all_or_first_failure(opens)
        except BaseException:
            await _cancel_all(*opens)
            raise
        streams = [task.result() for task in opens]
        rid = response_id(path)
        if client_streams and all(s.is_event_stream for s in streams):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return MergedRelayResponse(streams, subs, rid, include_usage, finish)
        try:
            answers = await asyncio.gather(*(s.aread() for s in streams))
        finally:
            for s in streams:
                await s.aclose()
        return JSONResponse(merge_answers(subs, answers, rid))

    async def _open_read(self, prefill: Instance, decode: Instance, path: str, body: dict,
                         headers: dict[str, str]) -> UpstreamStream:
        prefill_body = prefill_request_body(body, path, kv_params(do_remote_decode=True, **peer_kv_address(decode)))
        answer = await self._prefill(prefill, path, prefill_body, headers)
        kv_transfer_params = answer.get("kv_transfer_params")
        if not isinstance(kv_transfer_params, dict):
            raise RouterError(f"prefill instance {prefill.instance_id} answered without a kv_transfer_params "
                              "object; is it running with a KV connector in read mode?", 502,
                              "missing_kv_transfer_params")
        try:
            parse_kv_transfer_params(kv_transfer_params)
        except ValueError as e:
            raise RouterError(f"prefill instance {prefill.instance_id} answered {e}", 502,
                              "bad_kv_transfer_params") from None
        stream = await self.upstream.open_stream(decode, path, {**body, "kv_transfer_params": kv_transfer_params},
                                                 headers)
        stamp(logger, "router", "relay_start", headers["X-Request-Id"])
        return stream

    async def _open_write(self, prefill: Instance, decode: Instance, path: str, body: dict,
                          headers: dict[str, str]) -> UpstreamStream:
        transfer_id = uuid.uuid4().hex
        decode_body = {**body, "kv_transfer_params": kv_params(do_remote_prefill=True, mode="write",
                                                               transfer_id=transfer_id, **peer_kv_address(prefill))}
        prefill_body = prefill_request_body(body, path, kv_params(do_remote_decode=True, mode="write",
                                                                  transfer_id=transfer_id, **peer_kv_address(decode)))
        # prefill first: it computes at once (the TTFT path); decode's block ids reach it meanwhile
        prefill_task = asyncio.create_task(self._prefill(prefill, path, prefill_body, headers))
        decode_task = asyncio.create_task(self._open_decode(decode, path, decode_body, headers))
        try:
            stream = await self._decode_once_started(prefill_task, decode_task)
        except BaseException:
            await _cancel_all(prefill_task, decode_task)
            raise
        if not prefill_task.done():
            prefill_task.add_done_callback(partial(_log_late_prefill_failure, headers["X-Request-Id"]))
            stream.close_with(prefill_task)
        stamp(logger, "router", "relay_start", headers["X-Request-Id"])
        return stream

    async def _open_decode(self, decode: Instance, path: str, body: dict,
                           headers: dict[str, str]) -> UpstreamStream:
        """D's open response, once its first bytes arrived (peeked: its `head`)."""
        stream = await self.upstream.open_stream(decode, path, body, headers)
        try:
            await stream.peek()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    @staticmethod
    async def _decode_once_started(prefill_task: asyncio.Task, decode_task: asyncio.Task) -> UpstreamStream:
        """D's response once D showed output, or once P answered too when D's first event is not
        output; raise the first failure (P's when both failed in one wake-up: it is usually the
        cause of D's)."""
        while True:
            await asyncio.wait([t for t in (prefill_task, decode_task) if not t.done()],
                               return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done() and prefill_task.exception() is not None:
                raise prefill_task.exception()
            if decode_task.done():
                stream = decode_task.result()
                if has_output(stream.head, stream.is_event_stream) or prefill_task.done():
                    return stream
