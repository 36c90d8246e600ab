"""Structured outputs through PD: router + prefill + decode processes over tcp on the default model
(engine/default_model), read and write mode. The prefill's grammar constrains the one token it samples
and forwards; the decode's matcher is advanced with that token and constrains the rest. References:
jsonschema validation of every output, and the output of a collocated server for the same request
(greedy and seeded sampling, streamed and not)."""
import json

import jsonschema
import openai
import pytest

from tandem.engine.config import DEFAULT_MODEL_DIR
from tests.e2e.conftest import collocated_answers, wait_all_blocks_free
from tests.e2e.test_disagg import start_deployment

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "unit": {"enum": ["clips", "friends", "dollars"]}},
          "required": ["answer", "unit"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
QUESTIONS = ["Natalia sold clips to 48 of her friends. How many?",
             "Tom has 3 apples and buys 5 more. How many now?"]
CASES = [  # (question, request fields): each sent alone, compared with collocated exactly
    (QUESTIONS[0], dict(temperature=0)),
    (QUESTIONS[1], dict(temperature=0, stream=True)),
    (QUESTIONS[1], dict(temperature=1.0, seed=11)),
    (QUESTIONS[0], dict(temperature=0.8, top_p=0.9, seed=3, stream=True)),
]


def generate(base_url: str) -> list[tuple[str, str]]:
    """(content, finish_reason) of each case, one request at a time."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    out = []
    for question, kw in CASES:
        kw = dict(kw, model="default", messages=[{"role": "user", "content": question}], max_tokens=48,
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
    return collocated_answers(DEFAULT_MODEL_DIR, tmp_path_factory.mktemp("colloc-structured"), generate)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_structured_outputs_through_pd_match_collocated(tmp_path, expected, mode):
    for text, finish in expected:
        assert finish == "stop", text  # the reference itself completes the JSON
        jsonschema.validate(json.loads(text), SCHEMA)
    router, instances = start_deployment(DEFAULT_MODEL_DIR, tmp_path, mode, transport="tcp")
    try:
        got = generate(router.url)
        for text, _ in got:
            jsonschema.validate(json.loads(text), SCHEMA)
        assert got == expected
        wait_all_blocks_free([p.url for p in instances])
    finally:
        for p in [router, *instances]:
            p.stop()
