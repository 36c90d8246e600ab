"""Schemathesis, bounded: property-based requests generated from a server's own OpenAPI schema,
both schema-valid (positive) and schema-violating (negative), against a live base URL. The
reference is the schema itself plus OpenAI's rule that client input is never a 5xx: every
response must be no server error, a documented status and content type, and match its schema."""
import time

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import checks
from schemathesis.generation import GenerationMode

CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]
# Keep generated work small on a tiny CPU model: long prompts/outputs add time, not coverage.
_CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 4, "min_tokens": 4, "logprobs": 5, "top_logprobs": 5}


def _cap(case) -> None:
    body = case.body
    if isinstance(body, dict):
        body.setdefault("max_tokens", _CAPS["max_tokens"])  # chat's default is "up to the context length"
        for key, cap in _CAPS.items():
            value = body.get(key)
            if type(value) is int and value > cap:
                body[key] = cap


def fuzz(schema: dict, base_url: str, headers: dict[str, str], max_examples: int, time_budget_s: float,
         include_path: str | None = None) -> int:
    """Run every operation (or those under include_path) in both modes, max_examples each,
    stopping early when the time budget is spent; returns the number of requests made. Raises
    schemathesis' failure (with the reproducing request) on the first violated check."""
    loaded = schemathesis.openapi.from_dict(schema)
    deadline = time.monotonic() + time_budget_s
    calls = 0
    for result in loaded.get_all_operations():
        op = result.ok()
        if include_path is not None and not op.path.startswith(include_path):
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal calls
                if time.monotonic() > deadline:
                    return
                _cap(case)
                calls += 1
                case.call_and_validate(base_url=base_url, headers=headers, checks=CHECKS, timeout=60)

            try:
                run()
            except Unsatisfiable:  # negative mode of an operation without inputs: nothing to violate
                assert mode == GenerationMode.NEGATIVE, op.label
    return calls
