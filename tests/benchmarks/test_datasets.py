"""Workloads of benchmarks/serve.py (benchmarks/datasets.py).

Reference: a small ShareGPT-format file written here (prompts and reply lengths known), and for
prefix repetition the prompts' own structure (shared prefixes counted, suffix lengths)."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from benchmarks.datasets import build_prompts, load_sharegpt
from benchmarks.serve import BenchmarkConfig, parse_args, config_from_args


def _conversation(prompt: str, reply: str) -> dict:
    return {"id": prompt[:8], "conversations": [{"from": "human", "value": prompt},
                                                {"from": "gpt", "value": reply}]}


@pytest.fixture
def sharegpt_file(tmp_path):
    data = [
        _conversation("one two three four five", "a b c d e f"),  # 5 / 6 words
        _conversation("alpha beta gamma delta epsilon zeta", "x y z w"),  # 6 / 4
        _conversation("too short", "a b c d e"),  # prompt under 4: dropped
        _conversation("fine prompt with words here", "no"),  # reply under 4: dropped unless fixed
        _conversation("long " * 1100, "a b c d"),  # prompt over 1024: dropped
        {"id": "one-turn", "conversations": [{"from": "human", "value": "only one turn here ok"}]},
        "not a conversation",
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_load_sharegpt_takes_first_two_turns(sharegpt_file):
    pairs = load_sharegpt(sharegpt_file)
    assert len(pairs) == 5  # the one-turn item and the string are skipped
    assert pairs[0] == ("one two three four five", "a b c d e f")


def test_sharegpt_prompts_filter_and_lengths(sharegpt_file):
    config = BenchmarkConfig(dataset="sharegpt", dataset_path=str(sharegpt_file), num_prompts=4)
    prompts = build_prompts(config, random.Random(0), "token-ids")
    usable = {"one two three four five": (5, 6), "alpha beta gamma delta epsilon zeta": (6, 4)}
    assert len(prompts) == 4  # two usable conversations, cycled
    for p in prompts:
        assert isinstance(p.body, str) and (p.prompt_len, p.max_tokens) == usable[p.body]
    assert Counter(p.body for p in prompts) == {body: 2 for body in usable}


def test_sharegpt_fixed_output_len_keeps_short_replies(sharegpt_file):
    config = BenchmarkConfig(dataset="sharegpt", dataset_path=str(sharegpt_file), num_prompts=3,
                             sharegpt_output_len=7)
    prompts = build_prompts(config, random.Random(0), "words")
    assert {p.body for p in prompts} == {"one two three four five", "alpha beta gamma delta epsilon zeta",
                                         "fine prompt with words here"}
    assert all(p.max_tokens == 7 for p in prompts)


def test_sharegpt_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="--dataset-path"):
        build_prompts(BenchmarkConfig(dataset="sharegpt"), random.Random(0), "words")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        build_prompts(BenchmarkConfig(dataset="sharegpt", dataset_path=str(bad)), random.Random(0), "words")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps([_conversation("a", "b")]))
    with pytest.raises(ValueError, match="length filters"):
        build_prompts(BenchmarkConfig(dataset="sharegpt", dataset_path=str(empty)), random.Random(0), "words")


@pytest.mark.parametrize("prompt_format", ["token-ids", "words"])
def test_prefix_repetition_shares_prefixes(prompt_format):
    config = BenchmarkConfig(dataset="prefix-repetition", num_prompts=10, prefix_repetition_prefix_len=12,
                             prefix_repetition_suffix_len=5, prefix_repetition_num_prefixes=3,
                             prefix_repetition_output_len=9)
    prompts = build_prompts(config, random.Random(0), prompt_format)
    assert len(prompts) == 10
    bodies = [p.body if prompt_format == "token-ids" else p.body.split() for p in prompts]
    assert all(len(b) == 17 and p.prompt_len == 17 and p.max_tokens == 9 for b, p in zip(bodies, prompts))
    # 10 prompts over 3 prefixes: 4, 3, 3 prompts each; suffixes differ within a group
    by_prefix = Counter(tuple(b[:12]) for b in bodies)
    assert sorted(by_prefix.values()) == [3, 3, 4]
    assert len({tuple(b[12:]) for b in bodies}) == 10


def test_cli_dataset_flags_reach_the_config(sharegpt_file):
    args = parse_args(["--dataset", "prefix-repetition", "--prefix-repetition-num-prefixes", "4",
                       "--prefix-repetition-prefix-len", "64"])
    config = config_from_args(args)
    assert (config.dataset, config.prefix_repetition_num_prefixes, config.prefix_repetition_prefix_len) == \
        ("prefix-repetition", 4, 64)
    config = config_from_args(parse_args(["--dataset", "sharegpt", "--dataset-path", str(sharegpt_file)]))
    assert config.dataset_path == str(sharegpt_file)
    assert config_from_args(parse_args([])).dataset == "random"
