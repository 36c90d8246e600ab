"""The router's fan-out of batched prompts and n > 1 (router/fanout.py). Reference: the API
server's own numbering and seeding of n > 1 (server/generation.py: choice i*n+j, seed of sample j)
and OpenAI's usage rule (each prompt counted once)."""
import json

from tandem.router.fanout import merge_answers, split_request
from tandem.server.generation import choice_seed


def test_split_numbers_choices_like_the_server_and_seeds_each_sample():
    body = {"prompt": ["a", "b"], "n": 3, "seed": 9, "best_of": 3, "max_tokens": 4}
    subs = split_request(body, "/v1/completions")
    assert [(s.index, s.prompt_index, s.sample) for s in subs] == [(i * 3 + j, i, j) for i in range(2)
                                                                   for j in range(3)]
    assert [s.body["prompt"] for s in subs] == ["a"] * 3 + ["b"] * 3
    assert [s.body["seed"] for s in subs] == [choice_seed(9, j) for j in range(3)] * 2
    assert choice_seed(9, 0) == 9 and len({choice_seed(9, j) for j in range(3)}) == 3
    assert all(s.body["n"] == 1 and s.body["best_of"] == 1 and s.body["max_tokens"] == 4 for s in subs)


def test_split_keeps_token_id_prompts_and_chat():
    subs = split_request({"prompt": [[1, 2], [3]]}, "/v1/completions")
    assert [s.body["prompt"] for s in subs] == [[1, 2], [3]]
    subs = split_request({"messages": [{"role": "user", "content": "x"}], "n": 2}, "/v1/chat/completions")
    assert [s.body["messages"] for s in subs] == [[{"role": "user", "content": "x"}]] * 2
    assert all("seed" not in s.body for s in subs)


def test_single_choice_or_invalid_input_is_not_split():
    # None: the request goes to one transfer unchanged, so the instance answers any 400 itself
    for body in ({"prompt": "a"}, {"prompt": [1, 2, 3], "n": 1}, {"prompt": ["a"]}, {"prompt": "a", "n": 0},
                 {"prompt": "a", "n": 129}, {"prompt": "a", "n": "2"}, {"prompt": "a", "n": 2, "seed": 1 << 63},
                 {"prompt": [], "n": 1}, {"prompt": ["a", 1], "n": 1}):
        assert split_request(body, "/v1/completions") is None, body


def test_merge_counts_each_prompt_once_and_renumbers():
    subs = split_request({"prompt": ["a", "b"], "n": 2}, "/v1/completions")
    answers = [json.dumps({"id": f"cmpl-{k}", "object": "text_completion", "model": "m", "kv_transfer_params": {},
                           "choices": [{"index": 0, "text": f"t{k}", "finish_reason": "length"}],
                           "usage": {"prompt_tokens": 5 + s.prompt_index, "completion_tokens": k + 1,
                                     "total_tokens": 0}}).encode() for k, s in enumerate(subs)]
    merged = merge_answers(subs, answers, "cmpl-x")
    assert merged["id"] == "cmpl-x" and "kv_transfer_params" not in merged
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(k, f"t{k}") for k in range(4)]
    assert merged["usage"] == {"prompt_tokens": 11, "completion_tokens": 10, "total_tokens": 21}
