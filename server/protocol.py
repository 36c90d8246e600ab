"""OpenAI request schemas (pydantic, validated by FastAPI) and the JSON pieces of responses."""
import json
import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.engine.protocol import TokenLogprobs

MAX_LOGPROBS = 20
MAX_N = 128  # choices a request may ask for (the router splits n up to it, router/fanout.py)
_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp the same way
_SEED_STRIDE = 0x9E3779B97F4A7C15  # sample j > 0 of a seeded request gets a well-spread seed


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    # "schema" shadows a pydantic BaseModel attribute: read it through the alias
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field (exactly one constraint)."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # default here: compact JSON (weak models loop on whitespace)


class GenerationFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extensions).
    Fields nobody defines are kept in `model_extra`, logged and ignored (as vLLM does)."""

    model_config = ConfigDict(extra="allow")

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
    logit_bias: dict[str, float] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and legacy guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """OpenAI's rules: known roles only; content may be null only on an assistant message that
    makes tool calls; a tool message answers a tool_call_id."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} messages")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content is required on a {self.role} message (null only on an assistant "
                             f"message with tool_calls)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


def clamp_logprob(value: float) -> float:
    return value if value > _MIN_LOGPROB and not math.isnan(value) else _MIN_LOGPROB


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of sample j of a request seeded `seed` (j = 0 keeps it; None stays None). The
    router seeds the sub-requests of a PD deployment's n > 1 the same way (router/fanout.py)."""
    return seed if seed is None or j == 0 else (seed + j * _SEED_STRIDE) % (1 << 63)


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
