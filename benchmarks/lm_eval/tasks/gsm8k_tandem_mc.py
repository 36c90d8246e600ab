"""gsm8k_tandem_ll's documents: GSM8K test as 4-way multiple choice between whole solutions.

context: "Question: {question}\nAnswer:". choices: the gold solution (calculator notes `<<a*b=c>>`
removed, as in the default model's training text) and 3 copies of it whose final answer a is
replaced by a distractor d, both in the "#### a" line and at the last place a appears in the
working (usually the step that computes it), so a choice is told apart by whether that step's
arithmetic is right. Distractors: the first 3 distinct values of a+1, 2a, a-10, a+2, a+10, ...
(no randomness); choices are ordered by their final answer; gold: the index of a. lm-eval scores
" {choice}" after the context (target_delimiter " ").
"""
import re

import datasets

CALCULATOR_NOTE = re.compile(r"<<[^>]*>>")
NUMBER = re.compile(r"(?<![\d.])\d(?:[\d,]*\d)?(?:\.\d+)?")
_DISTRACTOR_RULES = (lambda a: a + 1, lambda a: 2 * a, lambda a: a - 10, lambda a: a + 2,
                     lambda a: a + 10, lambda a: a - 1, lambda a: a + 20)


def _final_answers(answer: int) -> list[int]:
    values = [answer]
    for rule in _DISTRACTOR_RULES:
        if rule(answer) not in values:
            values.append(rule(answer))
        if len(values) == 4:
            return sorted(values)
    raise AssertionError(f"fewer than 3 distinct distractors for {answer}")


def _with_answer(working: str, gold: int, value: int) -> str:
    """The solution with final answer `value`: the last number in `working` equal to `gold`
    (written with or without thousands commas) becomes `value`, then "#### value"."""
    last = None
    for m in NUMBER.finditer(working):
        if float(m.group().replace(",", "")) == abs(gold):
            last = m
    if last is not None and value != gold:
        text = f"{abs(value):,}" if "," in last.group() else str(abs(value))
        sign = "-" if (value < 0) != (gold < 0) else ""
        working = working[:last.start()] + sign + text + working[last.end():]
    return f"{working}#### {value}"


def _to_mc(doc: dict) -> dict:
    working, final = CALCULATOR_NOTE.sub("", doc["answer"]).rsplit("####", 1)
    gold = int(final.strip().replace(",", ""))
    answers = _final_answers(gold)
    return {"context": f"Question: {doc['question']}\nAnswer:",
            "choices": [_with_answer(working, gold, a) for a in answers], "gold": answers.index(gold)}


def process_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    # datasets fingerprints _to_mc by name, not code: its on-disk cache would outlive edits here.
    return dataset.map(_to_mc, load_from_cache_file=False, keep_in_memory=True)
