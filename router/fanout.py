"""n > 1 and batched prompts through a prefill/decode pair: one KV transfer per choice.

A client request with P prompts and n samples becomes P*n sub-requests, each with one prompt and
n=1, served as its own prefill+decode transfer; their answers merge into the one OpenAI answer a
collocated server gives: choice k = i*n + j (prompt i, sample j), usage with each prompt counted
once, one response id, streamed chunks relayed as they come with their choice's index.

Seeds: sample j of a seeded request is seeded `choice_seed(seed, j)`, the rule the API server
uses for its own n > 1 (this module imports it from server/generation.py), so PD output equals
collocated output choice by choice.
"""
import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tandem.router.errors import RouterError
from tandem.router.relay import OnClose, RelayResponse
from tandem.router.upstream import UpstreamStream
# (not server.generation: it imports the engine, torch); a larger n than MAX_N goes unsplit to the
# instance, which answers the 400
from tandem.server.protocol import MAX_N, choice_seed

_INT64 = 1 << 63


@dataclass(frozen=True)
class SubRequest:
    """One (prompt, sample) of a client request: its body (one prompt, n=1) and its choice index."""

    index: int
    prompt_index: int
    sample: int
    body: dict


def _prompts(body: dict, path: str) -> list | None:
    """The completion's prompts when it is a batch (a list of strings or of token-id lists)."""
    prompt = body.get("prompt")
    if path.endswith("/chat/completions") or not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt
    return None


def split_request(body: dict, path: str) -> list[SubRequest] | None:
    """The sub-requests of a batched or n > 1 request, or None when it is one choice (or invalid
    in n/seed, so that the instance answers the same 400 a collocated server would)."""
    n = body.get("n", 1)
    n = 1 if n is None else n
    if type(n) is not int or not 1 <= n <= MAX_N:
        return None
    seed = body.get("seed")
    if seed is not None and (type(seed) is not int or not -_INT64 <= seed < _INT64):
        return None
    prompts = _prompts(body, path)
    if n == 1 and (prompts is None or len(prompts) == 1):
        return None
    subs = []
    for i, prompt in enumerate(prompts if prompts is not None else [body.get("prompt")]):
        for j in range(n):
            sub = {**body, "n": 1}
            if prompts is not None:
                sub["prompt"] = prompt
            if seed is not None:
                sub["seed"] = choice_seed(seed, j)
            if body.get("best_of") == n:  # best_of == n is the only best_of served; per sample it is 1
                sub["best_of"] = 1
            subs.append(SubRequest(i * n + j, i, j, sub))
    return subs


def response_id(path: str) -> str:
    return f"{'chatcmpl' if path.endswith('/chat/completions') else 'cmpl'}-{uuid.uuid4().hex}"


class UsageSum:
    """OpenAI usage over the sub-requests: each prompt's tokens once (from its sample 0), every
    sample's completion and cached tokens (as the API server counts n > 1)."""

    def __init__(self) -> None:
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def add(self, sub: SubRequest, usage: dict) -> None:
        if sub.sample == 0:
            self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        self.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0

    def to_dict(self) -> dict:
        body = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_tokens:
            body["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return body


def _bad_answer(sub: SubRequest, what: str) -> RouterError:
    return RouterError(f"decode answer for choice {sub.index} is not an OpenAI response: {what}", 502,
                       "upstream_bad_response")


def merge_answers(subs: list[SubRequest], answers: list[bytes], rid: str) -> dict:
    """One OpenAI (chat) completion from the sub-requests' JSON answers, in choice order."""
    usage, choices, merged = UsageSum(), [], None
    for sub, raw in zip(subs, answers):
        try:
            answer = json.loads(raw)
            choice = answer["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise _bad_answer(sub, f"{type(e).__name__}: {raw[:200]!r}") from None
        merged = merged or answer
        choices.append({**choice, "index": sub.index})
        usage.add(sub, answer.get("usage") or {})
    out = {k: v for k, v in merged.items() if k != "kv_transfer_params"}
    return {**out, "id": rid, "choices": choices, "usage": usage.to_dict()}


def _sse_events(buffer: bytearray) -> list[bytes]:
    """Cut the complete SSE events (each ends with a blank line) off the front of `buffer`."""
    events = []
    while (end := buffer.find(b"\n\n")) >= 0:
        events.append(bytes(buffer[:end]))
        del buffer[:end + 2]
    return events


def _data(event: bytes) -> bytes | None:
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class MergedRelayResponse(RelayResponse):
    """Relays the SSE streams of the sub-requests as one stream: every chunk gets the response id
    and its choice's index; each stream's usage chunk and [DONE] are held back and replaced by one
    summed usage chunk (when the client asked for usage) and one [DONE]. A sub-stream that breaks
    or sends an error event ends the whole stream with that error."""

    def __init__(self, upstreams: list[UpstreamStream], subs: list[SubRequest], rid: str, include_usage: bool,
                 on_close: OnClose):
        self._subs, self._rid, self._include_usage = subs, rid, include_usage
        super().__init__(upstreams[0], on_close, upstreams)

    async def _pump(self, k: int, queue: asyncio.Queue) -> None:
        buffer = bytearray()
        try:
            async for chunk in self._upstreams[k].aiter_chunks():
                buffer += chunk.replace(b"\r\n", b"\n")
                for event in _sse_events(buffer):
                    await queue.put((k, event))
        except RouterError as e:
            await queue.put((k, e))
        await queue.put((k, None))

    async def relayed(self) -> AsyncIterator[bytes]:
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(k, queue)) for k in range(len(self._upstreams))]
        usage, running = UsageSum(), len(pumps)
        try:
            while running:
                k, event = await queue.get()
                if event is None:
                    running -= 1
                    continue
                if isinstance(event, RouterError):
                    raise event
                out = self._rewrite(self._subs[k], event, usage)
                if out is not None:
                    yield out
            if self._include_usage:
                yield self._chunk({"id": self._rid, "object": self._object, "created": self._created,
                                   "model": self._model, "choices": [], "usage": usage.to_dict()})
            yield b"data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    _object = _model = None
    _created = 0

    @staticmethod
    def _chunk(data: dict) -> bytes:
        return f"data: {json.dumps(data)}\n\n".encode()

    def _rewrite(self, sub: SubRequest, event: bytes, usage: UsageSum) -> bytes | None:
        data = _data(event)
        if data is None or data == b"[DONE]":
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            raise _bad_answer(sub, f"SSE data {data[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise _bad_answer(sub, f"SSE data {data[:200]!r}")
        if "error" in chunk:  # the instance's own error event: the stream ends with it
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            raise RouterError(str(error.get("message", chunk["error"])), 502, error.get("code") or "upstream_error")
        self._object = self._object or chunk.get("object")
        self._model = self._model or chunk.get("model")
        self._created = self._created or chunk.get("created", 0)
        if not chunk.get("choices"):
            if isinstance(chunk.get("usage"), dict):
                usage.add(sub, chunk["usage"])
            return None
        chunk["id"] = self._rid
        chunk.pop("kv_transfer_params", None)
        for choice in chunk["choices"]:
            choice["index"] = sub.index
        return self._chunk(chunk)
