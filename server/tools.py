"""Tool calling on /v1/chat/completions: tool_choice -> how the output is read (and, for
"required" or a named function, the grammar that forces it), and the output -> OpenAI
`tool_calls`, whole or as streamed deltas."""
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.sampling_params import StructuredOutputsParams
from tandem.server.errors import APIError
from tandem.server.tool_parsers import (JsonArrayToolParser, ParsedCall, ToolParser, arguments_json, get_tool_parser,
                                        stable_prefix)

logger = logging.getLogger(__name__)

_ANY_OBJECT = {"type": "object"}


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """How one chat request's output becomes tool calls. parser None: plain content.
    named: the output is this function's arguments (tool_choice names it)."""

    parser: ToolParser | None = None
    named: str | None = None
    structured: StructuredOutputsParams | None = None


def plan_tools(body, auto_parser: str | None) -> ToolPlan:
    """Check tools/tool_choice and decide. auto_parser: --tool-call-parser when
    --enable-auto-tool-choice is on, else None."""
    tools, choice = body.tools or [], body.tool_choice
    if choice is not None and not tools and choice != "none":
        raise APIError("tool_choice needs tools", param="tool_choice")
    if not tools or choice == "none":
        return ToolPlan()
    names = [t.function.name for t in tools]
    if choice is None or choice == "auto":
        if auto_parser is None:
            raise APIError('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                           '--tool-call-parser', param="tool_choice")
        return ToolPlan(parser=get_tool_parser(auto_parser))
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": t.function.parameters or _ANY_OBJECT},
                  "required": ["name", "parameters"]} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(parser=JsonArrayToolParser(), structured=StructuredOutputsParams(json=json.dumps(schema)))
    name = choice.function.name
    if name not in names:
        raise APIError(f"tool_choice names the function `{name}`, which is not among the tools "
                       f"({', '.join(names)})", param="tool_choice")
    params = next(t.function.parameters for t in tools if t.function.name == name) or _ANY_OBJECT
    return ToolPlan(named=name, structured=StructuredOutputsParams(json=json.dumps(params)))


def tool_call_json(index: int | None, call_id: str, name: str, arguments: str) -> dict:
    body = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return body if index is None else {"index": index, **body}


def final_message(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """The whole output -> (content, tool_calls) of the response message."""
    if plan.named is not None:
        return None, [tool_call_json(None, tool_call_id(), plan.named, text)]
    if plan.parser is None:
        return text, []
    content, calls = plan.parser.extract(text)
    return content, [tool_call_json(None, tool_call_id(), c.name, arguments_json(c.arguments)) for c in calls]


@dataclass
class _SentCall:
    id: str
    arguments: str = ""  # sent so far
    last_render: str = ""


@dataclass
class ToolCallStream:
    """Turns a growing output into chat deltas: content first, then tool-call deltas (id and
    name once, then argument text). The argument deltas of a call add up to its final
    arguments string; text that may begin a tool call is held back until it is clear."""

    plan: ToolPlan
    text: str = ""
    content_sent: int = 0
    calls: list[_SentCall] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def add(self, text: str, final: bool) -> dict:
        """Append new output text; the delta to send ({} when nothing is ready)."""
        self.text += text
        if self.plan.named is not None:
            return self._named(text)
        if self.plan.parser is None:
            return {"content": text} if text else {}
        content, calls = self._parse(final)
        delta: dict[str, Any] = {}
        if len(content) > self.content_sent and not self.calls:
            delta["content"] = content[self.content_sent:]
            self.content_sent = len(content)
        tool_deltas = [d for i, call in enumerate(calls) if (d := self._call_delta(i, call, final))]
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        return delta

    def _parse(self, final: bool) -> tuple[str, list[ParsedCall]]:
        if not final:
            return self.plan.parser.parse(self.text, final=False)
        content, calls = self.plan.parser.extract(self.text)
        if not calls and not self.calls:  # plain text (or malformed calls): all of it is content
            return self.text, []
        return content or "", calls

    def _named(self, text: str) -> dict:
        if not self.calls:
            self.calls.append(_SentCall(tool_call_id()))
            return {"tool_calls": [tool_call_json(0, self.calls[0].id, self.plan.named, text)]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def _call_delta(self, index: int, call: ParsedCall, final: bool) -> dict | None:
        if call.name is None:
            return None
        out: dict[str, Any] = {"index": index}
        if index == len(self.calls):
            self.calls.append(_SentCall(tool_call_id()))
            out.update(id=self.calls[index].id, type="function", function={"name": call.name, "arguments": ""})
        elif index > len(self.calls):
            return None
        sent = self.calls[index]
        render = arguments_json(call.arguments)
        target = render if call.done or final else stable_prefix(sent.last_render, render)
        sent.last_render = render
        if len(target) > len(sent.arguments):
            if not target.startswith(sent.arguments):
                logger.warning("streamed tool-call arguments diverged from the final ones (call %d)", index)
            else:
                out.setdefault("function", {})["arguments"] = target[len(sent.arguments):]
                sent.arguments = target
        return out if len(out) > 1 else None
