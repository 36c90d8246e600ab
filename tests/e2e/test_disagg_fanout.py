"""n > 1 and batched prompts through a `--role disagg` tree (tcp, read and write mode): the router
fans out one KV transfer per choice and merges the answers. Reference: a collocated server's
answer to the same request, choice by choice (index, text, finish reason) and its usage, greedy
and seeded, streamed and not; afterwards every KV block is free on both instances."""
import json

import httpx
import pytest

from tests.e2e.conftest import ENGINE_ARGS, KV_CONFIG, Proc, collocated_answers, pd_port_args, wait_all_blocks_free

pytestmark = pytest.mark.slow

P = [f"Question: Tom has {n} apples and buys {n + 3} more. How many now?\nAnswer:" for n in range(4)]
CHAT = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many now?"}]
CASES = [  # (path, body): each sent alone
    ("/v1/completions", {"prompt": P[0], "n": 3, "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"prompt": P[1], "n": 3, "max_tokens": 8, "temperature": 0.8, "seed": 11,
                         "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": [P[2], P[3]], "n": 2, "max_tokens": 6, "temperature": 0.9, "seed": 5}),
    ("/v1/completions", {"prompt": [P[0], P[3], P[1]], "max_tokens": 6, "temperature": 0, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 3,
                              "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 8, "temperature": 0.7, "seed": 42}),
]


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


def answers(url: str) -> list[dict]:
    out = []
    for path, body in CASES:
        resp = httpx.post(f"{url}{path}", json={"model": "default", **body}, timeout=120)
        out.append(_normalized(path, body, resp))
    return out


@pytest.fixture(scope="module")
def expected(model_dir, tmp_path_factory):
    return collocated_answers(model_dir, tmp_path_factory.mktemp("colloc"), answers)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_n_and_batched_prompts_match_collocated(model_dir, tmp_path, expected, mode):
    port_args, http_ports = pd_port_args()
    tree = Proc("disagg", ["--role", "disagg", "--model", str(model_dir), "--served-model-name", "default",
                           *ENGINE_ARGS, "--kv-mode", mode, *port_args, "--kv-transfer-config", KV_CONFIG], tmp_path)
    try:
        tree.wait_healthy(240)
        got = answers(tree.url)
        for case, g, want in zip(CASES, got, expected):
            assert g == want, case
        n_choices = [len(w["choices"]) for w in expected]
        assert n_choices == [3, 3, 4, 3, 3, 2]
        assert len(set(expected[1]["choices"].values())) > 1  # seeded samples differ from one another
        wait_all_blocks_free([f"http://127.0.0.1:{port}" for port in http_ports])
    finally:
        assert tree.stop(90) == 0
