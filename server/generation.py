"""From one OpenAI request to engine requests and back: validation, fan-out over prompts and
`n`, per-choice state (tokens, logprobs, incremental text, stop strings), and the output loop."""
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from tandem.connectors.params import parse_kv_transfer_params
from tandem.connectors.stages import side_of, stamp
from tandem.engine.protocol import EngineRequest, RequestOutput, TokenLogprobs
from tandem.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.server.detokenizer import IncrementalDetokenizer
from tandem.server.engine_client import EngineClient
from tandem.server.errors import APIError
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import MAX_LOGPROBS, MAX_N, GenerationFields, choice_seed, usage
from tandem.server.request_fields import check_extra_fields, logit_bias_of, structured_params
from tandem.server.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# generation_config.json keys that become default sampling parameters (as in vLLM)
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(setting: str, model_path: str) -> dict:
    """--generation-config: auto (the model folder's generation_config.json), vllm (none), or a
    folder -> {sampling field: default} for request fields left unset."""
    if setting == "vllm":
        return {}
    path = Path(model_path if setting == "auto" else setting) / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: no generation_config.json there")
        return {}
    raw = json.loads(path.read_text())
    defaults = {ours: raw[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if raw.get(theirs) is not None}
    if defaults:
        logger.info("default sampling parameters from %s: %s", path, defaults)
    return defaults


@dataclass
class ServingContext:
    """Everything a route needs: the engine client, the tokenizer, the model's limits."""

    client: EngineClient
    tokenizer: Tokenizer
    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    served_names: tuple[str, ...] = ()  # every name the API answers to (model_name is the first)
    defaults: dict = field(default_factory=dict)  # from generation_config.json (generation_defaults)
    tool_parser: str | None = None  # --tool-call-parser when --enable-auto-tool-choice is on

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, "default", self.model_path, *self.served_names):
            raise APIError(f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                           status=404, param="model", code="model_not_found")


@dataclass
class ChoiceDelta:
    """What one engine output added to a choice (text already cut at a stop string)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    text: str
    finish_reason: str | None


@dataclass
class Choice:
    """One engine request = one returned choice."""

    index: int
    request_id: str
    prompt_index: int
    prompt_token_ids: list[int]
    detok: IncrementalDetokenizer
    drop_output: bool = False  # echo with max_tokens=0: the one generated token is not returned
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: RequestOutput) -> ChoiceDelta:
        if out.finish_reason == "error":
            raise APIError(f"engine error on request {out.request_id}: {out.error or 'unknown'}", status=500)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        self.num_cached_tokens = out.num_cached_tokens
        new_ids = [] if self.drop_output else out.new_token_ids
        new_lps = out.new_logprobs or []
        # A stop token (EOS or stop_token_ids) ends the request but is not part of the text.
        text_until = len(new_ids) - 1 if out.finished and out.finish_reason == "stop" else len(new_ids)
        taken = len(new_ids)
        for i, token_id in enumerate(new_ids[:text_until]):
            if self.detok.add_token(token_id):
                taken = i + 1
                break
        delta_ids, delta_lps = new_ids[:taken], new_lps[:taken]
        self.token_ids += delta_ids
        self.logprobs += delta_lps
        if self.detok.stop_reason is not None:
            self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
        elif self.drop_output and out.finished:
            self.finish_reason = "length"
        elif out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if out.finished and self.detok.stop_reason is None:
            self.detok.finish()
            if self.detok.stop_reason is not None:
                self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
        return ChoiceDelta(delta_ids, delta_lps, self.detok.take_text(self.finished), self.finish_reason)


def make_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(body: GenerationFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None, seed: int | None, defaults: dict | None = None,
                    logit_bias: dict[int, float] | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """defaults: the model's generation_config values, used where the request leaves a field unset."""
    defaults = defaults or {}

    def pick(name: str, default):
        value = getattr(body, name)
        return defaults.get(name, default) if value is None else value

    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None and not math.isfinite(value):
            raise APIError(f"{name} must be a finite number, got {value}", param=name)

    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=body.min_tokens, temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0), top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=seed,
            presence_penalty=pick("presence_penalty", 0.0), frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0), ignore_eos=body.ignore_eos,
            stop_token_ids=list(body.stop_token_ids or []), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias, structured_outputs=structured)
    except ValueError as exc:
        raise APIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc


def check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}", param=param)


def build_requests(ctx: ServingContext, body: GenerationFields, request_id: str, prompts: list[list[int]],
                   max_tokens: int | None, logprobs: int | None = None, prompt_logprobs: int | None = None,
                   drop_output: bool = False, forced_structure: StructuredOutputsParams | None = None
                   ) -> tuple[list[EngineRequest], dict[str, Choice]]:
    """Validate and fan out: prompt i, sample j -> engine request `{request_id}-{i}-{j}`, choice i*n+j.
    max_tokens None means the model's default (generation_config's max_new_tokens) or else "up to
    the context length". forced_structure: the grammar tool_choice imposes."""
    check_extra_fields(body)
    structured = structured_params(body, forced_structure)
    logit_bias = logit_bias_of(body, ctx.vocab_size)
    if max_tokens is None and "max_tokens" in ctx.defaults:
        max_tokens = min(ctx.defaults["max_tokens"], ctx.max_model_len - max(map(len, prompts), default=0))
        max_tokens = max_tokens if max_tokens >= 1 else None
    if not 1 <= body.n <= MAX_N:
        raise APIError(f"n must be between 1 and {MAX_N}, got {body.n}", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    for ids in prompts:
        if not ids:
            raise APIError("the prompt is empty", param="prompt")
        bad = next((t for t in ids if not 0 <= t < ctx.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is out of range for a vocabulary of {ctx.vocab_size}", param="prompt")
        wanted = len(ids) + (max_tokens or 1)
        if wanted > ctx.max_model_len:
            raise APIError(f"this model's maximum context length is {ctx.max_model_len} tokens, but {wanted} were "
                           f"requested ({len(ids)} in the prompt, {max_tokens or 1} to generate); shorten the "
                           f"prompt or lower max_tokens", param="max_tokens" if max_tokens else "prompt")
    if body.seed is not None and not -(1 << 63) <= body.seed < (1 << 63):
        raise APIError(f"seed must fit in a signed 64-bit integer, got {body.seed}", param="seed")
    bad = next((t for t in body.stop_token_ids or [] if not 0 <= t < ctx.vocab_size), None)
    if bad is not None:
        raise APIError(f"stop token id {bad} is out of range for a vocabulary of {ctx.vocab_size}",
                       param="stop_token_ids")
    try:
        kv_transfer_params = parse_kv_transfer_params(body.kv_transfer_params)
    except ValueError as e:
        raise APIError(str(e), param="kv_transfer_params") from None
    stops = body.stop_strings
    requests, choices = [], {}
    arrival = time.time()
    for i, ids in enumerate(prompts):
        for j in range(body.n):
            seed = choice_seed(body.seed, j)  # the router seeds a PD deployment's samples the same way
            params = sampling_params(body, max_tokens, logprobs, prompt_logprobs, seed, ctx.defaults, logit_bias,
                                     structured)
            rid = f"{request_id}-{i}-{j}"
            stamp(logger, side_of(kv_transfer_params), "api.built", rid)
            requests.append(EngineRequest(rid, ids, params, arrival, kv_transfer_params))
            choices[rid] = Choice(i * body.n + j, rid, i, ids, drop_output=drop_output, arrival_time=arrival,
                                  detok=IncrementalDetokenizer(ctx.tokenizer, ids, stops, body.skip_special_tokens))
    return requests, choices


async def run_choices(ctx: ServingContext, requests: list[EngineRequest],
                      choices: dict[str, Choice]) -> AsyncIterator[tuple[Choice, ChoiceDelta]]:
    """Send the requests, apply each output to its choice, abort a choice when a stop string
    ends it. Leaving early (error, client disconnect) aborts whatever still runs."""
    metrics = ctx.metrics
    side = side_of(requests[0].kv_transfer_params) if requests else "colloc"
    async with ctx.client.add_requests(requests) as stream:
        for req in requests:
            stamp(logger, side, "api.sent", req.request_id)
        try:
            async for out in stream:
                choice = choices[out.request_id]
                now = time.time()
                if out.times is not None:
                    metrics.observe_times(out.times)
                delta = choice.apply(out)
                if out.new_token_ids:
                    if choice.first_token_time is None:
                        stamp(logger, side, "api.first_token", out.request_id)
                        choice.first_token_time = now
                        metrics.ttft.observe(now - choice.arrival_time)
                    else:
                        metrics.itl.observe(now - choice.last_token_time)
                    choice.last_token_time = now
                if choice.finished:
                    if not out.finished:
                        stream.abort(out.request_id)
                    metrics.observe_finished(choice.finish_reason, choice.arrival_time, choice.first_token_time,
                                             now, len(choice.prompt_token_ids), len(choice.token_ids))
                yield choice, delta
        finally:
            for rid in stream.pending:  # left early: these are aborted on the way out
                metrics.observe_aborted(len(choices[rid].prompt_token_ids), len(choices[rid].token_ids))


def choices_usage(choices: dict[str, Choice], num_prompt_tokens: int) -> dict:
    """OpenAI usage: each prompt counted once (not once per sample), every choice's tokens."""
    return usage(num_prompt_tokens, sum(len(c.token_ids) for c in choices.values()),
                 sum(c.num_cached_tokens for c in choices.values()))


def kv_transfer_params_of(choices: dict[str, Choice]) -> dict | None:
    """What the engine's KV connector returned for the client (PD disaggregation), if anything."""
    return next((c.kv_transfer_params for c in choices.values() if c.kv_transfer_params), None)
