"""Structured outputs (xgrammar bitmask in the sampler) and logit_bias on the default model.
References: jsonschema validation / re.fullmatch / set membership of every output; for
unconstrained requests batched with constrained ones, their output alone; for async
scheduling, the synchronous engine; for logit_bias, the unbiased greedy run."""
import json
import re

import jsonschema
import pytest

from tandem.engine import LLM, SamplingParams
from tandem.engine.sampling_params import StructuredOutputsParams as Structured
from tandem.engine.structured_output import grammar_of

PROMPT = "<|im_start|>user\nNatalia sold clips to 48 of her friends. How many?<|im_end|>\n<|im_start|>assistant\n"
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 999},
        "unit": {"enum": ["clips", "friends", "dollars"]},
        "detail": {"type": "object", "properties": {"exact": {"type": "boolean"},
                                                    "tags": {"type": "array", "maxItems": 3,
                                                             "items": {"enum": ["add", "sub", "mul"]}}},
                   "required": ["exact", "tags"]},
    },
    "required": ["answer", "unit", "detail"],
}
REGEX = r"[0-9]{2,3}-(yes|no)"
CHOICES = ["forty-eight", "twenty four", "72"]


@pytest.fixture(scope="module")
def llm(request):
    return LLM(device="cpu", max_model_len=512, max_num_seqs=8)


def _specs():
    return [(Structured(json=json.dumps(SCHEMA)), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
            (Structured(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(f"{t!r} !~ {REGEX}")),
            (Structured(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(f"{t!r} not a choice"))]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_validate_mixed_with_free_requests(llm, temperature):
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llm.generate([PROMPT], free)[0].token_ids
    specs = _specs()
    params = [SamplingParams(max_tokens=128, temperature=temperature, seed=i, structured_outputs=s)
              for i, (s, _) in enumerate(specs * 2)]
    outs = llm.generate([PROMPT] * (len(params) + 1), params + [free])
    for out, (_, check) in zip(outs, specs * 2):
        assert out.finish_reason == "stop", out.text
        check(out.text)
    assert outs[-1].token_ids == alone  # the masks of its neighbours do not touch it


def test_async_scheduling_gives_the_synchronous_outputs(llm):
    """Constrained requests force synchronous steps; outputs equal --no-async-scheduling's."""
    assert llm.engine.async_scheduling
    params = [SamplingParams(max_tokens=16, temperature=0, structured_outputs=s) for s, _ in _specs()[1:]]
    params.append(SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    sync = LLM(device="cpu", max_model_len=512, max_num_seqs=8, async_scheduling=False)
    runs = [[o.token_ids for o in engine.generate([PROMPT] * len(params), params)] for engine in (llm, sync)]
    assert runs[0] == runs[1]


def test_invalid_specs_raise_naming_the_kind():
    for spec, kind in [(Structured(json='{"type": "nope"}'), "json"), (Structured(regex="[a-"), "regex"),
                       (Structured(grammar="root ::= missing"), "grammar")]:
        with pytest.raises(ValueError, match=f"invalid {kind}"):
            grammar_of(spec)
    with pytest.raises(ValueError, match="exactly one"):
        Structured(regex="a", choice=["a"])


def test_logit_bias_moves_the_greedy_token(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    banned = {t: -100.0 for t in base}
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias=banned))[0]
    assert not set(out.token_ids) & set(banned)
    forced = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                   logit_bias={77: 100.0}))[0]
    assert forced.token_ids == [77] * 4
    sampled = llm.generate([PROMPT] * 4, [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True,
                                                         logit_bias=banned) for s in range(4)])
    assert all(not set(o.token_ids) & set(banned) for o in sampled)
