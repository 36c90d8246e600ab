"""Request fields beyond sampling: structured outputs (response_format, vLLM's structured_outputs
and guided_*), logit_bias, and the OpenAI fields Tandem does not implement (a 400 naming them)."""
import json
import logging

from tandem.engine.sampling_params import StructuredOutputsParams
from tandem.engine.structured_output import grammar_of
from tandem.server.errors import APIError
from tandem.server.protocol import GenerationFields

logger = logging.getLogger(__name__)

# OpenAI request fields Tandem does not implement, with the values that ask for nothing (accepted).
_UNIMPLEMENTED = {
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "functions": (None,), "function_call": (None, "none"), "reasoning_effort": (None,), "verbosity": (None,),
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
}
# OpenAI fields that are hints only: accepted without a word.
_HINTS = {"prompt_cache_key", "safety_identifier"}


def check_extra_fields(body: GenerationFields) -> None:
    """400 for an unimplemented OpenAI field that asks for something; one log line for the rest."""
    extra = body.model_extra or {}
    for name, value in extra.items():
        if name in _UNIMPLEMENTED and value not in _UNIMPLEMENTED[name]:
            raise APIError(f"`{name}` is not supported by this server", param=name)
    unknown = sorted(k for k in extra if k not in _UNIMPLEMENTED and k not in _HINTS)
    if unknown:
        logger.warning("ignoring unknown request fields: %s", ", ".join(unknown))


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise APIError(f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise APIError(f"{param} must be a JSON schema object", param=param)
    return json.dumps(schema)


def _sources(body: GenerationFields) -> list[tuple[str, dict]]:
    """Each structured-output request in the body as (field name, StructuredOutputsParams kwargs)."""
    found = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.json_schema is None:
            found.append(("response_format", {"json_object": True}))
        else:
            found.append(("response_format", {"json": _schema_text(fmt.json_schema.json_schema, "response_format")}))
    so = body.structured_outputs
    if so is not None:
        kwargs = {"any_whitespace": so.disable_any_whitespace is False}
        if so.json_schema is not None:
            kwargs["json"] = _schema_text(so.json_schema, "structured_outputs")
        kwargs.update({k: v for k, v in (("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar),
                                         ("json_object", so.json_object)) if v is not None})
        found.append(("structured_outputs", kwargs))
    if body.guided_json is not None:
        found.append(("guided_json", {"json": _schema_text(body.guided_json, "guided_json")}))
    for name, key in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            found.append((name, {key: getattr(body, name)}))
    return found


def structured_params(body: GenerationFields, forced: StructuredOutputsParams | None = None
                      ) -> StructuredOutputsParams | None:
    """The request's output grammar, checked (400 naming the field when invalid). forced: one
    that tool_choice imposes; it may not be combined with another."""
    sources = _sources(body)
    if forced is not None:
        sources.append(("tool_choice", None))
    if len(sources) > 1:
        raise APIError(f"only one structured-output constraint per request; got {', '.join(n for n, _ in sources)}",
                       param=sources[1][0])
    if not sources:
        return None
    param, kwargs = sources[0]
    try:
        spec = forced if kwargs is None else StructuredOutputsParams(**kwargs)
        grammar_of(spec)
    except ValueError as exc:
        raise APIError(f"{param}: {exc}", param=param) from exc
    return spec


def logit_bias_of(body: GenerationFields, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id as a string -> bias in [-100, 100]) with ids checked."""
    if not body.logit_bias:
        return None
    out = {}
    for key, bias in body.logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise APIError(f"logit_bias token id {token_id} is out of range for a vocabulary of {vocab_size}",
                           param="logit_bias")
        if not -100 <= bias <= 100:
            raise APIError(f"logit_bias values must be in [-100, 100], got {bias}", param="logit_bias")
        out[token_id] = float(bias)
    return out
