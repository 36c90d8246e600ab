"""Grammar-constrained decoding with xgrammar (JSON schema, any JSON, regex, choice, EBNF).

The API process checks a request's grammar with `grammar_of` (no tokenizer needed, cheap);
the engine core compiles it against the vocabulary (`GrammarCompiler`, cached by xgrammar)
and keeps one `GrammarMatcher` per request. Each step the sampler asks the matchers of the
batch's constrained rows for a token bitmask and masks the logits with it; the scheduler
advances a matcher with every token it appends. A constrained request never runs an async
step (EngineCore._async_safe): its next mask needs the token just sampled.
"""
import json
import logging
import re

import torch

from tandem.engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_XGR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] [^ ]+:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(exc: Exception) -> str:
    """xgrammar's C++ errors start with a time stamp and a source location: keep the message."""
    return _XGR_LOG_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar accepting exactly one of `choices` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_ANY_OBJECT = '{"type": "object"}'  # json_object: an object (the builtin JSON grammar allows any value)


def grammar_of(spec: StructuredOutputsParams):
    """The xgrammar Grammar of `spec`; ValueError naming the field when it is invalid."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            return xgr.Grammar.from_json_schema(spec.json or _ANY_OBJECT, any_whitespace=spec.any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except Exception as exc:  # xgrammar raises RuntimeError for every bad grammar
        raise ValueError(f"invalid {kind} for structured output: {_clean(exc)}") from exc


class GrammarCompiler:
    """Compiles structured-output specs against the model's vocabulary (engine core only).
    vocab_size: the logits' width (the model config's, which may exceed the tokenizer's)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler = None

    def _get(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            logger.info("xgrammar compiler ready: vocab=%d stop tokens=%s", self.vocab_size, self.eos_token_ids)
        return self._compiler

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh GrammarMatcher for one request; ValueError when the grammar is invalid."""
        import xgrammar as xgr

        compiler = self._get()
        try:
            if spec.kind in ("json", "json_object"):
                compiled = compiler.compile_json_schema(spec.json or _ANY_OBJECT, any_whitespace=spec.any_whitespace)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            else:
                compiled = compiler.compile_grammar(choice_ebnf(spec.choice) if spec.kind == "choice" else spec.grammar)
        except Exception as exc:
            raise ValueError(f"invalid {spec.kind} for structured output: {_clean(exc)}") from exc
        return xgr.GrammarMatcher(compiled)


def apply_grammar_bitmask(logits: torch.Tensor, matchers: list) -> None:
    """Mask, in place, the tokens each row's grammar forbids next.
    logits: [N, V] float32 on any device; matchers: [N] GrammarMatcher or None (unconstrained).
    The bitmask is filled on the host ([N, ceil(V/32)] int32) and applied on logits' device."""
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    if logits.is_cuda:
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
