"""OpenAI request schemas (pydantic, validated by FastAPI) and the JSON pieces of responses."""
import json
import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.protocol import TokenLogprobs

MAX_LOGPROBS = 20
_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp the same way


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # PD disaggregation: passed through to EngineRequest.kv_transfer_params (see connectors/).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


def clamp_logprob(value: float) -> float:
    return value if value > _MIN_LOGPROB and not math.isnan(value) else _MIN_LOGPROB


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


SSE_DONE = "data: [DONE]\n\n"


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def now() -> int:
    return int(time.time())


def completion_logprobs(token_strs: list[str], entries: list[TokenLogprobs | None], top_strs: list[list[str]],
                        num_top: int, text_offset: int = 0) -> dict:
    """OpenAI legacy logprobs: tokens, token_logprobs, top_logprobs ({token: logprob}, the chosen
    token included), text_offset. An entry of None (the first prompt token) gives nulls."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, entry, tops in zip(token_strs, entries, top_strs):
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clamp_logprob(entry.logprobs[0]))
        top = {s: clamp_logprob(lp) for s, lp in zip(tops[:num_top], entry.logprobs[1:1 + num_top])}
        top.setdefault(token, clamp_logprob(entry.logprobs[0]))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(token_strs: list[str], entries: list[TokenLogprobs], top_strs: list[list[str]],
                  num_top: int) -> dict:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for token, entry, tops in zip(token_strs, entries, top_strs):
        content.append({
            "token": token, "logprob": clamp_logprob(entry.logprobs[0]), "bytes": list(token.encode()),
            "top_logprobs": [{"token": s, "logprob": clamp_logprob(lp), "bytes": list(s.encode())}
                             for s, lp in zip(tops[:num_top], entry.logprobs[1:1 + num_top])],
        })
    return {"content": content}
