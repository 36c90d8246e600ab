"""Tool-call parsers on canned model texts. References: the calls written into the texts;
for streaming, the non-streamed result (deltas reassembled must equal it)."""
import json

import pytest

from tandem.server.tool_parsers import HermesToolParser, JsonArrayToolParser, Llama3JsonToolParser
from tandem.server.tools import ToolCallStream, ToolPlan, final_message

WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, 2], "note": "say \"hi\" \u00e9"}
TIME = {"tz": "UTC"}

HERMES_ONE = f'<tool_call>\n{json.dumps({"name": "get_weather", "arguments": WEATHER})}\n</tool_call>'
HERMES_TWO = (f'Let me check.\n<tool_call>\n{json.dumps({"name": "get_weather", "arguments": WEATHER})}\n</tool_call>\n'
              f'<tool_call>\n{json.dumps({"name": "get_time", "arguments": TIME})}\n</tool_call>')
LLAMA_ONE = json.dumps({"name": "get_weather", "parameters": WEATHER})
LLAMA_TWO = "<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": WEATHER}) + "; " + json.dumps(
    {"name": "get_time", "parameters": TIME})
ARRAY_TWO = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": TIME}])

CASES = [
    (HermesToolParser, HERMES_ONE, None, [("get_weather", WEATHER)]),
    (HermesToolParser, HERMES_TWO, "Let me check.\n", [("get_weather", WEATHER), ("get_time", TIME)]),
    (Llama3JsonToolParser, LLAMA_ONE, None, [("get_weather", WEATHER)]),
    (Llama3JsonToolParser, LLAMA_TWO, None, [("get_weather", WEATHER), ("get_time", TIME)]),
    (JsonArrayToolParser, ARRAY_TWO, None, [("get_weather", WEATHER), ("get_time", TIME)]),
]
MALFORMED = [
    (HermesToolParser, 'I think <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
    (HermesToolParser, '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    (HermesToolParser, "The answer is 48 clips."),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Par'),
    (Llama3JsonToolParser, "The answer is 48 clips."),
    (Llama3JsonToolParser, '{"city": "Paris"}'),  # an object, but no call
]


@pytest.mark.parametrize("parser_cls,text,content,calls", CASES)
def test_final_parse(parser_cls, text, content, calls):
    got_content, got_calls = final_message(ToolPlan(parser=parser_cls()), text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)


@pytest.mark.parametrize("parser_cls,text", MALFORMED)
def test_malformed_is_plain_content(parser_cls, text):
    assert final_message(ToolPlan(parser=parser_cls()), text) == (text, [])


def _reassemble(plan: ToolPlan, text: str, chunk: int) -> tuple[str, list[tuple[str, str]]]:
    stream, content, calls = ToolCallStream(plan), "", {}
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for i, piece in enumerate(pieces):
        delta = stream.add(piece, final=i == len(pieces) - 1)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            entry = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert entry["name"] is None, "id and name are sent once"
                entry["name"] = d["function"]["name"]
            entry["arguments"] += d.get("function", {}).get("arguments", "")
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
@pytest.mark.parametrize("parser_cls,text,content,calls", CASES + [(c, t, t, []) for c, t in MALFORMED[2::3]])
def test_streamed_deltas_reassemble_to_the_final_calls(parser_cls, text, content, calls, chunk):
    plan = ToolPlan(parser=parser_cls())
    want_content, want_calls = final_message(plan, text)
    got_content, got_calls = _reassemble(plan, text, chunk)
    assert got_content == (want_content or "")
    assert got_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]


def test_named_function_streams_its_arguments_verbatim():
    text = json.dumps(WEATHER)
    plan = ToolPlan(named="get_weather")
    assert _reassemble(plan, text, 5) == ("", [("get_weather", text)])
    assert final_message(plan, text)[1][0]["function"] == {"name": "get_weather", "arguments": text}


def test_content_is_held_back_only_while_it_may_start_a_call():
    stream = ToolCallStream(ToolPlan(parser=HermesToolParser()))
    assert stream.add("Hello <tool", final=False) == {"content": "Hello "}
    assert stream.add("box>", final=False) == {"content": "<toolbox>"}
