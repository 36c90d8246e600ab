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
KV_BYTES = 1 << 27  # per engine: two engines share the GPU in one test


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def llm(request):
    """The default model on CPU, and on a GPU with its defaults (CUDA graphs, async scheduling)."""
    return LLM(device=request.param, max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=KV_BYTES)


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
    sync = LLM(device=llm.engine.config.model.device, max_model_len=512, max_num_seqs=8, async_scheduling=False,
               compile_ahead=False, kv_cache_memory_bytes=KV_BYTES)
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


class _ForwardingConnector:
    """Decode-side stand-in: hands the scheduler one prefill-sampled first token per request."""

    recompute_on_failure = False
    first_token_at_step = False

    def __init__(self, first_tokens: dict[str, int]):
        self.first_tokens = first_tokens

    def take_first_tokens(self):
        out, self.first_tokens = {rid: (t, None) for rid, t in self.first_tokens.items()}, {}
        return out

    def on_request_finished(self, req):
        return False, None


def test_pd_forwarded_first_token_advances_or_fails_the_grammar(llm):
    """A PD decode advances its matcher with the prefill's token as if it had sampled it; a token
    the grammar rejects ends the request with an error naming it. Reference: the matcher's own
    acceptance of the same token sequence."""
    from tandem.engine.protocol import EngineRequest

    core, tok = llm.engine, llm.tokenizer
    good, bad = tok.encode("forty", add_special_tokens=False)[0], tok.encode("72", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=Structured(choice=["forty-eight"]))
    ids = tok.encode(PROMPT, add_special_tokens=False)
    saved = core.scheduler.connector
    try:
        core.scheduler.connector = _ForwardingConnector({"ok": good, "bad": bad})
        core.add_request(EngineRequest("ok", ids, params))
        core.add_request(EngineRequest("bad", ids, params))
        core.scheduler._take_first_tokens()
    finally:
        core.scheduler.connector = saved
    outs = {o.request_id: o for o in core.scheduler.pending_outputs}
    assert outs["bad"].finish_reason is not None and str(bad) in outs["bad"].error and not outs["bad"].new_token_ids
    assert outs["ok"].new_token_ids == [good] and outs["ok"].error is None
    # The matcher moved past `good`: the rest continues the choice instead of starting it again.
    outputs = []  # (the first step also returns the pending outputs above)
    while core.has_unfinished_requests():
        outputs += core.step()
    text = tok.decode([t for o in outputs if o.request_id == "ok" for t in o.new_token_ids], skip_special_tokens=True)
    assert text == "forty-eight"
    assert core.blocks.num_free_blocks == core.blocks.num_blocks
