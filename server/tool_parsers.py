"""Tool-call parsers: the model's text -> (content, tool calls), whole or as it grows.

`--tool-call-parser hermes` reads `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks (Hermes, Qwen2.5, Qwen3); `llama3_json` reads `{"name": ..., "parameters": {...}}`
objects separated by `;`, optionally after `<|python_tag|>` (Llama 3.1+). Two more serve
tool_choice "required" (a JSON array of {name, parameters}, forced by a grammar) and a named
function (the output is that function's arguments). A parser's `parse(text, final)` returns
what the text holds so far; with final=False an unfinished call is parsed leniently
(partial-json-parser) and text that may start a tool-call marker is held back.
"""
import json
import re
from dataclasses import dataclass
from typing import Any

import partial_json_parser
from partial_json_parser import Allow


@dataclass
class ParsedCall:
    """One tool call as far as it is known. name None: not known yet; done: its JSON is closed."""

    name: str | None
    arguments: Any
    done: bool


class MalformedToolCall(ValueError):
    """The final text was meant as a tool call but does not parse: it is returned as content."""


def _partial(text: str) -> Any:
    try:
        return partial_json_parser.loads(text, Allow.ALL) if text.strip() else None
    except Exception:  # not even a JSON prefix (yet)
        return None


def _call_of(obj: Any, done: bool, args_keys: tuple[str, ...]) -> ParsedCall | None:
    """A ParsedCall from a (partial) {"name": ..., "arguments"|"parameters": ...} object."""
    if not isinstance(obj, dict):
        if done:
            raise MalformedToolCall(f"a tool call must be a JSON object, got {type(obj).__name__}")
        return None
    key = next((k for k in args_keys if k in obj), None)
    name = obj.get("name")
    if done and (not isinstance(name, str) or key is None or not isinstance(obj[key], dict)):
        raise MalformedToolCall("a tool call needs a string `name` and an object of arguments")
    if key is None or not isinstance(name, str):  # the name is complete once the arguments began
        return ParsedCall(None, None, False)
    return ParsedCall(name, obj[key] if isinstance(obj[key], dict) else {}, done)


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of text could be the start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Base: subclasses implement parse(text, final) -> (content, calls)."""

    def parse(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The final text: (content or None, complete calls); malformed calls -> all content."""
        try:
            content, calls = self.parse(text, final=True)
        except MalformedToolCall:
            return text, []
        if not calls:
            return text, []
        return (content if content.strip() else None), calls


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        start = text.find(self.START)
        if start < 0:
            return text if final else text[:len(text) - _held_back(text, self.START)], []
        calls = []
        for block in text[start:].split(self.START)[1:]:
            body, closed = block, False
            if self.END in block:
                body, closed = block[:block.index(self.END)], True
            if final:
                try:
                    obj = json.loads(body)
                except json.JSONDecodeError as exc:
                    raise MalformedToolCall(str(exc)) from exc
                calls.append(_call_of(obj, True, ("arguments", "parameters")))
            else:
                call = _call_of(_partial(body), False, ("arguments", "parameters"))
                if call is not None:
                    call.done = closed and call.name is not None
                    calls.append(call)
        return text[:start], calls


class Llama3JsonToolParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        body = text.lstrip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        elif not body.startswith("{"):
            if not final and self.PYTHON_TAG.startswith(body):
                return "", []  # may become the tag
            return text, []
        if not body:
            return "", []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                if final:
                    raise MalformedToolCall(str(exc)) from exc
                call = _call_of(_partial(body[pos:]), False, ("parameters", "arguments"))
                if call is not None:
                    calls.append(call)
                break
            calls.append(_call_of(obj, True, ("parameters", "arguments")))
            pos = end
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
        return "", calls


class JsonArrayToolParser(ToolParser):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} (grammar-forced)."""

    def parse(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        if final:
            try:
                items = json.loads(text)
            except json.JSONDecodeError as exc:
                raise MalformedToolCall(str(exc)) from exc
            if not isinstance(items, list):
                raise MalformedToolCall("expected a JSON array of tool calls")
            return "", [_call_of(item, True, ("parameters", "arguments")) for item in items]
        items = _partial(text)
        if not isinstance(items, list):
            return "", []
        calls = [_call_of(item, i < len(items) - 1, ("parameters", "arguments")) for i, item in enumerate(items)]
        return "", [c for c in calls if c is not None]


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


def arguments_json(arguments: Any) -> str:
    """The arguments string of a tool call in a response (streamed deltas add up to this)."""
    return json.dumps(arguments, ensure_ascii=False)


_CLOSERS = re.compile(r'["}\]]+$')


def stable_prefix(previous: str, current: str) -> str:
    """The part of a partial call's arguments JSON that later text cannot change: the common
    prefix of the last two renderings, minus closing quotes/brackets (a string or object may
    still grow there)."""
    n = 0
    for a, b in zip(previous, current):
        if a != b:
            break
        n += 1
    return _CLOSERS.sub("", current[:n])
