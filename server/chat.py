"""POST /v1/chat/completions: messages through the model's chat template, chat-format logprobs,
n, stop strings, tool calls, streaming (role delta with a choice's first output)."""
import json

from fastapi.responses import JSONResponse, StreamingResponse

from tandem.server.errors import APIError, stream_error
from tandem.server.generation import (ServingContext, build_requests, check_logprobs, choices_usage, kv_transfer_params_of,
                               make_request_id, run_choices)
from tandem.server.protocol import SSE_DONE, ChatCompletionRequest, ChatMessage, chat_logprobs, now, sse
from tandem.server.tools import ToolCallStream, ToolPlan, final_message, plan_tools


def _arguments(text: str):
    """Tool-call arguments for the template: the parsed object (templates render it with tojson)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _message_dict(message: ChatMessage) -> dict:
    """A message for the chat template; content given as parts is joined into one string;
    developer becomes system (templates know only the older name)."""
    out = message.model_dump(exclude_none=True)
    if message.role == "developer":
        out["role"] = "system"
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in message.tool_calls]
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(f"only text content parts are supported, got type {part.get('type')!r}",
                               param="messages")
            texts.append(part["text"])
        out["content"] = "\n".join(texts)
    elif content is None:
        out["content"] = ""
    return out


def _logprobs_json(ctx: ServingContext, token_ids: list[int], entries: list, num_top: int) -> dict:
    tok = ctx.tokenizer.token_str
    return chat_logprobs([tok(t) for t in token_ids], entries, [[tok(t) for t in e.token_ids[1:]] for e in entries],
                         num_top)


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest):
    ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
    check_logprobs(body.top_logprobs, "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    plan = plan_tools(body, ctx.tool_parser)
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.tools:
        template_kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    prompt = ctx.tokenizer.apply_chat_template([_message_dict(m) for m in body.messages], body.add_generation_prompt,
                                               **template_kwargs)
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    request_id = make_request_id("chatcmpl")
    requests, choices = build_requests(ctx, body, request_id, [prompt], max_tokens, num_top,
                                       forced_structure=plan.structured)
    base = {"id": request_id, "created": now(), "model": ctx.model_name}

    if body.stream:
        return StreamingResponse(_stream(ctx, body, requests, choices, base, len(prompt), num_top, plan),
                                 media_type="text/event-stream")

    async for _ in run_choices(ctx, requests, choices):
        pass
    out_choices = []
    for c in sorted(choices.values(), key=lambda c: c.index):
        content, tool_calls = final_message(plan, c.detok.text)
        message = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        out_choices.append({
            "index": c.index, "message": message,
            "logprobs": None if num_top is None else _logprobs_json(ctx, c.token_ids, c.logprobs, num_top),
            "finish_reason": _finish_reason(c.finish_reason, bool(tool_calls)), "stop_reason": c.stop_reason})
    response = {**base, "object": "chat.completion", "choices": out_choices,
                "usage": choices_usage(choices, len(prompt))}
    kv_params = kv_transfer_params_of(choices)
    if kv_params is not None:
        response["kv_transfer_params"] = kv_params
    return JSONResponse(response)


def _finish_reason(reason: str | None, made_tool_calls: bool) -> str | None:
    return "tool_calls" if made_tool_calls and reason == "stop" else reason


async def _stream(ctx, body, requests, choices, base, num_prompt_tokens, num_top, plan: ToolPlan):
    base = {**base, "object": "chat.completion.chunk"}
    tool_streams = {rid: ToolCallStream(plan) for rid in choices}
    started: set[str] = set()  # choices whose role delta went out
    try:
        async for choice, delta in run_choices(ctx, requests, choices):
            if choice.request_id not in started:
                # with the choice's first output, as vLLM: a PD router reads decode's first event as its first token
                started.add(choice.request_id)
                yield sse({**base, "choices": [{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            tools = tool_streams[choice.request_id]
            message = tools.add(delta.text, delta.finish_reason is not None)
            if not message and delta.finish_reason is None and (num_top is None or not delta.token_ids):
                continue
            data = {**base, "choices": [{
                "index": choice.index, "delta": message,
                "logprobs": None if num_top is None else _logprobs_json(ctx, delta.token_ids, delta.logprobs, num_top),
                "finish_reason": _finish_reason(delta.finish_reason, tools.has_calls),
                "stop_reason": choice.stop_reason}]}
            if delta.finish_reason is not None and choice.kv_transfer_params is not None:
                data["kv_transfer_params"] = choice.kv_transfer_params
            yield sse(data)
        if body.include_usage:
            yield sse({**base, "choices": [], "usage": choices_usage(choices, num_prompt_tokens)})
    except Exception as exc:  # headers are out: the error becomes the last event
        yield sse(stream_error(exc))
    yield SSE_DONE
