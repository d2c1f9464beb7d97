"""Tool-call parsing over given text (whole and streamed), the tool grammar, and how a chat
request's tools and formats become a plan; no server."""

from __future__ import annotations

import json

import pytest

from hybridmoe.loader.chat_template import ChatTemplate
from hybridmoe.server.errors import ApiError
from hybridmoe.server.protocol import ChatCompletionRequest
from hybridmoe.server.structured import plan_chat
from hybridmoe.server.tools import (
    TOOL_CALL_FORMATS,
    QwenToolCalls,
    ToolCall,
    ToolCallParsing,
    format_for_template,
    parse_tool_calls,
)
from qwen_tool_template import QWEN_TOOL_TEMPLATE

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
WEATHER = ToolCall("get_weather", '{"city": "Paris", "days": 2}')
TEXTS = {
    CALL: (None, [WEATHER]),
    "Let me look.\n" + CALL: ("Let me look.", [WEATHER]),
    f"{CALL}\n{CALL}\n": (None, [WEATHER, WEATHER]),
    f"a {CALL} b": ("a  b", [WEATHER]),
    "no calls < here <tool": ("no calls < here <tool", []),
    "<tool_call>\nnot json\n</tool_call>": ("<tool_call>\nnot json\n</tool_call>", []),
    '<tool_call>{"name": 3}</tool_call>': ('<tool_call>{"name": 3}</tool_call>', []),
    '<tool_call>\n{"name": "f", "arguments": {}': (
        '<tool_call>\n{"name": "f", "arguments": {}',
        [],
    ),
    '<tool_call>{"name": "f"}</tool_call>': (None, [ToolCall("f", "{}")]),
    "  \n": (None, []),
}


@pytest.mark.parametrize(("text", "expected"), TEXTS.items())
def test_parse_whole_text(text, expected):
    assert parse_tool_calls(QwenToolCalls, text) == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("piece", [1, 2, 7])
def test_streamed_pieces_assemble_to_the_whole_parse(text, piece):
    stream = QwenToolCalls.stream()
    events = []
    for start in range(0, len(text), piece):
        events += stream.feed(text[start : start + piece])
    events += stream.finish()
    content = "".join(e for e in events if isinstance(e, str)) or None
    assert (content, [e for e in events if isinstance(e, ToolCall)]) == TEXTS[text]
    assert all(e for e in events), "no empty content pieces"


@pytest.mark.parametrize("piece", [1, 1000])
def test_without_parallel_calls_only_the_first_is_kept(piece):
    text = f"a {CALL}\n{CALL} b"
    whole = parse_tool_calls(ToolCallParsing(QwenToolCalls, parallel=False), text)
    assert whole == ("a \n b", [WEATHER])
    stream = ToolCallParsing(QwenToolCalls, parallel=False).stream()
    events = [e for i in range(0, len(text), piece) for e in stream.feed(text[i : i + piece])]
    assert [e for e in events + stream.finish() if isinstance(e, ToolCall)] == [WEATHER]


def test_a_call_is_not_emitted_before_it_is_closed():
    stream = QwenToolCalls.stream()
    assert stream.feed(CALL[:-1]) == []
    assert stream.feed(CALL[-1]) == [WEATHER]


def test_the_format_is_found_by_its_template():
    assert TOOL_CALL_FORMATS["qwen"] is QwenToolCalls
    assert format_for_template(QWEN_TOOL_TEMPLATE) is QwenToolCalls
    assert format_for_template("{{ messages }}") is None


def _request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "noop"}},
]


def _plan(template: str = QWEN_TOOL_TEMPLATE, **fields):
    r = _request(**fields)
    return plan_chat(r.response_format, r.tools, r.tool_choice, r.parallel_tool_calls, template)


def test_plans():
    auto = _plan(tools=TOOLS)
    assert auto.grammar is None and auto.tool_parsing == ToolCallParsing(QwenToolCalls, True)
    assert [t["function"]["name"] for t in auto.template_tools] == ["get_weather", "noop"]
    none = _plan(tools=TOOLS, tool_choice="none")
    assert none.template_tools is None and none.tool_parsing is None and none.grammar is None
    required = _plan(tools=TOOLS, tool_choice="required")
    assert required.grammar.kind == "lark" and required.grammar_param == "tools"
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "noop"}})
    assert '"noop"' in named.grammar.source and "get_weather" not in named.grammar.source
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    structured = _plan(response_format=fmt)
    assert json.loads(structured.grammar.source) == schema
    assert structured.grammar_param == "response_format.json_schema.schema"
    assert _plan(response_format={"type": "text"}).grammar is None


def test_tools_need_a_template_that_renders_them():
    with pytest.raises(ApiError, match="does not render tools") as e:
        _plan("{{ messages }}", tools=TOOLS)
    assert e.value.param == "tools"
    with pytest.raises(ApiError, match="no parser") as e:
        _plan("{% for tool in tools %}{{ tool }}{% endfor %}", tools=TOOLS)


def test_history_tool_calls_reach_the_template_as_objects():
    calls = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    request = _request(
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
    )
    messages = [m.template_dict() for m in request.messages]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2]["tool_call_id"] == "c1"
    text = ChatTemplate(QWEN_TOOL_TEMPLATE, "test", {}).render(messages, True, TOOLS)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert '{"type": "function", "function": {"name": "noop"}}' in text
