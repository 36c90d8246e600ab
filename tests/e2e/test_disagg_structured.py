"""Structured outputs through PD: router + prefill + decode processes over tcp on the default model
(engine/default_model), read and write mode. The prefill's grammar constrains the one token it samples
and forwards; the decode's matcher is advanced with that token and constrains the rest. References:
jsonschema validation of every output, and the output of a collocated server for the same request
(greedy and seeded sampling, streamed and not). One prefill and one decode instance serve both modes,
each behind a router of its own --kv-mode."""
import json

import jsonschema
import openai
import pytest

from tandem.engine.config import DEFAULT_MODEL_DIR
from tests.e2e.conftest import collocated_answers, wait_all_blocks_free
from tests.e2e.test_disagg_tp import Tree

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "unit": {"enum": ["clips", "friends", "dollars"]}},
          "required": ["answer", "unit"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
# Questions of each mode's test: the instances serve both, and a decode finding the other mode's
# prompts in its prefix cache would receive only their last block.
QUESTIONS = {"read": ["Natalia sold clips to 48 of her friends. How many?",
                      "Tom has 3 apples and buys 5 more. How many now?"],
             "write": ["Weng sold clips to 36 of her friends. How many?",
                       "Sam has 4 apples and buys 7 more. How many now?"]}
CASES = [  # (question index, request fields): each sent alone, compared with collocated exactly
    (0, dict(temperature=0)),
    (1, dict(temperature=0, stream=True)),
    (1, dict(temperature=1.0, seed=11)),
    (0, dict(temperature=0.8, top_p=0.9, seed=3, stream=True)),
]


def generate(base_url: str, questions: list[str]) -> list[tuple[str, str]]:
    """(content, finish_reason) of each case, one request at a time."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    out = []
    for question, kw in CASES:
        kw = dict(kw, model="default", messages=[{"role": "user", "content": questions[question]}], max_tokens=48,
                  response_format=FORMAT)
        if kw.pop("stream", False):
            chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
            out.append(("".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason))
        else:
            c = client.chat.completions.create(**kw).choices[0]
            out.append((c.message.content, c.finish_reason))
    return out


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    return collocated_answers(DEFAULT_MODEL_DIR, tmp_path_factory.mktemp("colloc-structured"),
                              lambda url: {mode: generate(url, questions) for mode, questions in QUESTIONS.items()})


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    tree = Tree(DEFAULT_MODEL_DIR, [], tmp_path_factory.mktemp("pd-structured"))
    try:
        tree.start("prefill0", "prefill", 1)
        tree.start("decode0", "decode", 1)
        yield tree
    finally:
        tree.close()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_structured_outputs_through_pd_match_collocated(tree, expected, mode):
    for text, finish in expected[mode]:
        assert finish == "stop", text  # the reference itself completes the JSON
        jsonschema.validate(json.loads(text), SCHEMA)
    got = generate(tree.route(mode), QUESTIONS[mode])
    for text, _ in got:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert got == expected[mode]
    wait_all_blocks_free([p.url for p in tree.instances.values()])
