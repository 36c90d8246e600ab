"""POST /v1/completions: prompts as text or token ids, echo + prompt logprobs (lm-eval's
loglikelihood), legacy logprobs, n, stop strings, streaming."""
from fastapi.responses import JSONResponse, StreamingResponse

from tandem.server.errors import APIError, stream_error
from tandem.server.generation import (Choice, ServingContext, build_requests, check_logprobs, choices_usage,
                               kv_transfer_params_of, make_request_id, run_choices)
from tandem.server.protocol import SSE_DONE, CompletionRequest, completion_logprobs, now, sse


def _prompts(ctx: ServingContext, prompt) -> tuple[list[list[int]], list[str | None]]:
    """Token ids per prompt, and the prompt text when it was given as text."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError("the prompt is empty", param="prompt")
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise APIError("the prompt is empty", param="prompt")
            ids.append(ctx.tokenizer.encode(p))
            texts.append(p)
        else:
            ids.append(list(p))
            texts.append(None)
    return ids, texts


def _logprobs_json(ctx: ServingContext, token_ids: list[int], entries: list, num_top: int, offset: int) -> dict:
    tok = ctx.tokenizer.token_str
    return completion_logprobs([tok(t) for t in token_ids], entries,
                               [[tok(t) for t in e.token_ids[1:]] if e is not None else [] for e in entries],
                               num_top, offset)


class _Echo:
    """The prompt part of an echoed choice: text, ids and prompt logprobs (first entry None)."""

    def __init__(self, ctx: ServingContext, choice: Choice, text: str | None):
        self.text = text if text is not None else ctx.tokenizer.decode(choice.prompt_token_ids, False)
        self.token_ids = choice.prompt_token_ids
        self.entries = choice.prompt_logprobs or [None] * len(self.token_ids)


async def create_completion(ctx: ServingContext, body: CompletionRequest):
    ctx.check_model(body.model)
    if body.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError("best_of is not supported (only best_of == n)", param="best_of")
    check_logprobs(body.logprobs, "logprobs")
    if body.max_tokens is not None and body.max_tokens < (0 if body.echo else 1):
        raise APIError(f"max_tokens must be at least {0 if body.echo else 1}, got {body.max_tokens}",
                       param="max_tokens")
    prompts, texts = _prompts(ctx, body.prompt)
    echo_only = body.echo and body.max_tokens == 0
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    request_id = make_request_id("cmpl")
    requests, choices = build_requests(ctx, body, request_id, prompts, 1 if echo_only else body.max_tokens,
                                       body.logprobs, prompt_logprobs, drop_output=echo_only)
    base = {"id": request_id, "object": "text_completion", "created": now(), "model": ctx.model_name}

    def choice_logprobs(token_ids, entries, offset):
        return None if body.logprobs is None else _logprobs_json(ctx, token_ids, entries, body.logprobs, offset)

    if body.stream:
        return StreamingResponse(_stream(ctx, body, requests, choices, texts, base, prompts, choice_logprobs),
                                 media_type="text/event-stream")

    async for _ in run_choices(ctx, requests, choices):
        pass
    out_choices = []
    for choice in sorted(choices.values(), key=lambda c: c.index):
        text, token_ids, entries = choice.detok.text, choice.token_ids, choice.logprobs
        if body.echo:
            echo = _Echo(ctx, choice, texts[choice.prompt_index])
            text, token_ids, entries = echo.text + text, echo.token_ids + token_ids, echo.entries + entries
        out_choices.append({"index": choice.index, "text": text, "logprobs": choice_logprobs(token_ids, entries, 0),
                            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
    response = {**base, "choices": out_choices, "usage": choices_usage(choices, sum(map(len, prompts)))}
    kv_params = kv_transfer_params_of(choices)
    if kv_params is not None:
        response["kv_transfer_params"] = kv_params
    return JSONResponse(response)


async def _stream(ctx, body, requests, choices, texts, base, prompts, choice_logprobs):
    started: set[str] = set()  # choices whose first chunk (with the echoed prompt) went out
    offsets = {rid: 0 for rid in choices}  # text_offset of each choice's next token
    try:
        async for choice, delta in run_choices(ctx, requests, choices):
            rid = choice.request_id
            text, token_ids, entries = delta.text, delta.token_ids, delta.logprobs
            if body.echo and rid not in started:
                echo = _Echo(ctx, choice, texts[choice.prompt_index])
                text, token_ids, entries = echo.text + text, echo.token_ids + token_ids, echo.entries + entries
            started.add(rid)
            if not text and delta.finish_reason is None and (body.logprobs is None or not token_ids):
                continue
            logprobs = choice_logprobs(token_ids, entries, offsets[rid])
            offsets[rid] += sum(len(ctx.tokenizer.token_str(t)) for t in token_ids)
            data = {**base, "choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                                         "finish_reason": delta.finish_reason, "stop_reason": choice.stop_reason}]}
            if delta.finish_reason is not None and choice.kv_transfer_params is not None:
                data["kv_transfer_params"] = choice.kv_transfer_params
            yield sse(data)
        if body.include_usage:
            yield sse({**base, "choices": [], "usage": choices_usage(choices, sum(map(len, prompts)))})
    except Exception as exc:  # headers are out: the error becomes the last event
        yield sse(stream_error(exc))
    yield SSE_DONE
