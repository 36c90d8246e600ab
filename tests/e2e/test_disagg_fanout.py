"""n > 1 and batched prompts through router + prefill + decode processes (tcp, read and write mode):
the router fans out one KV transfer per choice and merges the answers. Reference: a collocated
server's answer to the same request, choice by choice (index, text, finish reason) and its usage,
greedy and seeded, streamed and not; afterwards every KV block is free on both instances. One
prefill and one decode instance serve both modes, each behind a router of its own --kv-mode."""
import json

import httpx
import pytest

from tests.e2e.conftest import collocated_answers, wait_all_blocks_free
from tests.e2e.test_disagg_tp import Tree

pytestmark = pytest.mark.slow


def cases(name: str) -> list[tuple[str, dict]]:
    """(path, body) of each request, each sent alone, asking about `name`: each mode's test its own
    (the instances serve both, and a decode finding the other mode's prompts in its prefix cache
    would receive only their last block)."""
    p = [f"Question: {name} has {n} apples and buys {n + 3} more. How many now?\nAnswer:" for n in range(4)]
    chat = [{"role": "user", "content": f"{name} has 3 apples and buys 4 more. How many now?"}]
    return [
        ("/v1/completions", {"prompt": p[0], "n": 3, "max_tokens": 8, "temperature": 0}),
        ("/v1/completions", {"prompt": p[1], "n": 3, "max_tokens": 8, "temperature": 0.8, "seed": 11,
                             "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"prompt": [p[2], p[3]], "n": 2, "max_tokens": 6, "temperature": 0.9, "seed": 5}),
        ("/v1/completions", {"prompt": [p[0], p[3], p[1]], "max_tokens": 6, "temperature": 0, "stream": True,
                             "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": chat, "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 3,
                                  "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": chat, "n": 2, "max_tokens": 8, "temperature": 0.7, "seed": 42}),
    ]


CASES = {"read": cases("Tom"), "write": cases("Sam")}


def _normalized(path: str, body: dict, resp: httpx.Response) -> dict:
    """{index: (text, finish_reason)} and usage (prompt, completion tokens) of an answer."""
    assert resp.status_code == 200, resp.text
    chat = path.endswith("chat/completions")
    if not body.get("stream"):
        data = resp.json()
        choices = {c["index"]: ((c["message"]["content"] if chat else c["text"]), c["finish_reason"])
                   for c in data["choices"]}
        assert len(choices) == len(data["choices"])
        usage = data["usage"]
    else:
        events = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1  # one response id across the choices
        texts, reasons = {}, {}
        for chunk in chunks:
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + ((c["delta"].get("content") or "") if chat
                                                                 else c["text"])
                reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
        choices = {i: (texts[i], reasons[i]) for i in texts}
        usage = [c for c in chunks if c.get("usage")]
        assert len(usage) == 1 and not usage[0]["choices"]
        usage = usage[0]["usage"]
    return {"choices": choices, "usage": (usage["prompt_tokens"], usage["completion_tokens"])}


def answers(url: str, cases: list[tuple[str, dict]]) -> list[dict]:
    out = []
    for path, body in cases:
        resp = httpx.post(f"{url}{path}", json={"model": "default", **body}, timeout=120)
        out.append(_normalized(path, body, resp))
    return out


@pytest.fixture(scope="module")
def expected(model_dir, tmp_path_factory):
    return collocated_answers(model_dir, tmp_path_factory.mktemp("colloc"),
                              lambda url: {mode: answers(url, cases) for mode, cases in CASES.items()})


@pytest.fixture(scope="module")
def tree(model_dir, tmp_path_factory):
    tree = Tree(model_dir, [], tmp_path_factory.mktemp("pd-fanout"))
    try:
        tree.start("prefill0", "prefill", 1)
        tree.start("decode0", "decode", 1)
        yield tree
    finally:
        tree.close()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_n_and_batched_prompts_match_collocated(tree, expected, mode):
    got = answers(tree.route(mode), CASES[mode])
    for case, g, want in zip(CASES[mode], got, expected[mode]):
        assert g == want, case
    n_choices = [len(w["choices"]) for w in expected[mode]]
    assert n_choices == [3, 3, 4, 3, 3, 2]
    assert len(set(expected[mode][1]["choices"].values())) > 1  # seeded samples differ from one another
    wait_all_blocks_free([p.url for p in tree.instances.values()])
