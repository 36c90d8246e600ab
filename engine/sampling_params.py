"""Per-request sampling parameters, validated where they are built."""
import msgspec

_GREEDY_EPS = 1e-5
_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """A grammar the output must follow (see engine/structured_output.py); exactly one kind."""

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-like)
    any_whitespace: bool = False  # json: allow free whitespace (weak models may loop on it)

    def __post_init__(self) -> None:
        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_KINDS)}; "
                             f"got {', '.join(kinds) or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs choice must list at least one string")

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))



class SamplingParams(msgspec.Struct, omit_defaults=True):
    """What to generate and how. Invalid values raise ValueError naming the field."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one always included)
    prompt_logprobs: int | None = None  # top-N per prompt token (first token has none)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100..100)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias must map token ids >= 0 to values in [-100, 100], got "
                                 f"{token_id}: {bias}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
