"""POST /tokenize and /detokenize, with vLLM's request and response shapes."""
from collections.abc import Callable

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from tandem.server.chat import _message_dict
from tandem.server.errors import APIError
from tandem.server.generation import ServingContext
from tandem.server.protocol import ChatMessage, ChatTool


class TokenizeRequest(BaseModel):
    """Either `prompt` (completion style) or `messages` (rendered with the chat template)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def tokenize_router(serving: Callable[..., ServingContext]) -> APIRouter:
    """/tokenize and /detokenize; `serving(body)` is the ready context (503 while loading, 400 on bad text)."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        ctx = serving(body)
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            tokens = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            kwargs = dict(body.chat_template_kwargs or {})
            if body.tools:
                kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
            tokens = ctx.tokenizer.apply_chat_template([_message_dict(m) for m in body.messages],
                                                       body.add_generation_prompt, **kwargs)
            if body.add_special_tokens:
                tokens = ctx.tokenizer.hf.build_inputs_with_special_tokens(tokens)
        return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens,
                "token_strs": [ctx.tokenizer.token_str(t) for t in tokens] if body.return_token_strs else None}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        ctx = serving(body)
        ctx.check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < ctx.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is out of range for a vocabulary of {ctx.vocab_size}", param="tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return router
