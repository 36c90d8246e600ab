"""Workloads for benchmarks/serve.py: what each request sends (prompt body, length, max_tokens).

- random (default): random tokens, input/output lengths uniform in len*(1±r), after an optional
  prefix shared by all prompts (--random-prefix-len).
- sharegpt: conversations from a local ShareGPT-format JSON file (--dataset-path): the first
  human turn is the prompt, the first reply's length the output length.
- prefix-repetition: --prefix-repetition-num-prefixes random prefixes, each reused by an equal
  share of the prompts with a fresh random suffix (prefix-cache workloads), shuffled.

Prompt bodies come in one of three formats (see serve.run_benchmark): "token-ids" (lists of ids
for servers that accept them), "tokenizer-text" (random ids of a real tokenizer, as text) and
"words" (common English words, about one token each).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.serve import BenchmarkConfig

logger = logging.getLogger(__name__)

DATASETS = ("random", "sharegpt", "prefix-repetition")
# Token ids below this are often special/control tokens in common vocabularies.
MIN_RANDOM_TOKEN_ID = 100
# Common English words that most BPE vocabularies encode as one token each (with a leading space).
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who its now find "
    "long down day did get come made may part over new sound take only little work know place year live"
).split()
# ShareGPT filters, as vLLM's: drop tiny conversations and ones that do not fit a 2k context.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class Prompt:
    body: str | list[int]  # text, or token ids for servers that accept them on /v1/completions
    prompt_len: int  # client-side token count (an estimate for word prompts and text without a tokenizer)
    max_tokens: int


class RandomTokens:
    """Random prompt pieces in one prompt format; `join` turns pieces into one Prompt body."""

    def __init__(self, prompt_format: str, rng: random.Random, vocab_size: int, tokenizer: Any = None):
        self.format, self.rng, self.vocab_size, self.tokenizer = prompt_format, rng, vocab_size, tokenizer
        if prompt_format == "tokenizer-text":
            special = set(tokenizer.all_special_ids)
            self.usable = [i for i in range(len(tokenizer)) if i not in special]

    def draw(self, n: int) -> list:
        """n random tokens: ids (token-ids, tokenizer-text) or words."""
        if self.format == "token-ids":
            return [self.rng.randrange(MIN_RANDOM_TOKEN_ID, self.vocab_size) for _ in range(n)]
        if self.format == "tokenizer-text":
            return self.rng.choices(self.usable, k=n)
        return self.rng.choices(WORDS, k=n)

    def join(self, pieces: list, max_tokens: int) -> Prompt:
        if self.format == "token-ids":
            return Prompt(pieces, len(pieces), max_tokens)
        if self.format == "words":
            return Prompt(" ".join(pieces), len(pieces), max_tokens)
        ids, target = pieces, len(pieces)
        # Decode/encode does not round-trip exactly: re-encode, trim or pad the tail, retry.
        for _ in range(4):
            text = self.tokenizer.decode(ids)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == target:
                break
            ids = ids[:target] + self.rng.choices(self.usable, k=max(0, target - len(ids)))
        return Prompt(text, len(self.tokenizer.encode(text, add_special_tokens=False)), max_tokens)


def sample_lengths(config: BenchmarkConfig, rng: random.Random) -> list[tuple[int, int]]:
    """(input_len, output_len) per prompt, uniform in [len*(1-r), len*(1+r)] like vLLM's random set."""
    if not 0.0 <= config.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {config.random_range_ratio}")
    r = config.random_range_ratio

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - r)), int(n * (1 + r))))

    return [(draw(config.random_input_len), draw(config.random_output_len)) for _ in range(config.num_prompts)]


def random_prompts(config: BenchmarkConfig, tokens: RandomTokens) -> list[Prompt]:
    """Random prompts sharing a random prefix of --random-prefix-len tokens."""
    lengths = sample_lengths(config, tokens.rng)
    prefix = tokens.draw(config.random_prefix_len)
    return [tokens.join(prefix + tokens.draw(n), out) for n, out in lengths]


def prefix_repetition_prompts(config: BenchmarkConfig, tokens: RandomTokens) -> list[Prompt]:
    """num_prompts prompts over num_prefixes shared prefixes (an equal share each, the remainder
    to the first ones), every prompt with its own random suffix; order shuffled."""
    n, k = config.num_prompts, config.prefix_repetition_num_prefixes
    if k < 1 or config.prefix_repetition_prefix_len < 0 or config.prefix_repetition_suffix_len < 1:
        raise ValueError("--prefix-repetition-num-prefixes and --prefix-repetition-suffix-len must be >= 1, "
                         "--prefix-repetition-prefix-len >= 0")
    prefixes = [tokens.draw(config.prefix_repetition_prefix_len) for _ in range(k)]
    prompts = [tokens.join(prefixes[i % k] + tokens.draw(config.prefix_repetition_suffix_len),
                           config.prefix_repetition_output_len) for i in range(n)]
    tokens.rng.shuffle(prompts)
    return prompts


def _count_tokens(text: str, tokenizer: Any) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else len(text.split())


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every conversation in a ShareGPT-format JSON file: a list
    of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read ShareGPT file {path}: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    pairs = []
    for item in data:
        if not isinstance(item, dict):
            continue
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) >= 2 and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs


def sharegpt_prompts(config: BenchmarkConfig, rng: random.Random, tokenizer: Any = None) -> list[Prompt]:
    """Prompts from --dataset-path in shuffled order (cycled when the file has fewer usable ones).
    Lengths are counted with the tokenizer when given, else as whitespace-separated words (the
    server's usage.prompt_tokens replaces the prompt's count). --sharegpt-output-len fixes every
    output length; otherwise each is the reply's length."""
    if not config.dataset_path:
        raise ValueError("--dataset sharegpt needs --dataset-path FILE (ShareGPT-format JSON)")
    pairs = load_sharegpt(config.dataset_path)
    rng.shuffle(pairs)
    prompts = []
    for prompt, reply in pairs:
        prompt_len = _count_tokens(prompt, tokenizer)
        output_len = config.sharegpt_output_len or _count_tokens(reply, tokenizer)
        fixed_output = config.sharegpt_output_len is not None
        if prompt_len < SHAREGPT_MIN_LEN or (not fixed_output and output_len < SHAREGPT_MIN_LEN):
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        prompts.append(Prompt(prompt, prompt_len, output_len))
    if not prompts:
        raise ValueError(f"{config.dataset_path}: no conversation passes the length filters "
                         f"({SHAREGPT_MIN_LEN}..{SHAREGPT_MAX_PROMPT_LEN} prompt tokens, "
                         f"<= {SHAREGPT_MAX_TOTAL_LEN} in all)")
    if len(prompts) < config.num_prompts:
        logger.warning("%s has %d usable conversations for %d prompts: cycling through them",
                       config.dataset_path, len(prompts), config.num_prompts)
    return [prompts[i % len(prompts)] for i in range(config.num_prompts)]


def build_prompts(config: BenchmarkConfig, rng: random.Random, prompt_format: str,
                  tokenizer: Any = None) -> list[Prompt]:
    """The workload of config.dataset, prompt bodies in prompt_format (ShareGPT prompts are text)."""
    if config.dataset == "sharegpt":
        return sharegpt_prompts(config, rng, tokenizer)
    tokens = RandomTokens(prompt_format, rng, config.vocab_size, tokenizer)
    if config.dataset == "prefix-repetition":
        return prefix_repetition_prompts(config, tokens)
    if config.dataset == "random":
        return random_prompts(config, tokens)
    raise ValueError(f"unknown dataset {config.dataset!r}; expected one of {', '.join(DATASETS)}")
