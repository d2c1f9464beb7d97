"""logprobs, response_format and tools through a live server and the official `openai` client.
The checkpoint is the demo with a Qwen3-style tool template (tests/qwen_tool_template.py): the
demo model knows no tools, so tool calls come from constrained decoding (tool_choice required)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from hybridmoe.loader.tokenizer import Tokenizer
from live_server import LiveServer, start_server, stop_server
from qwen_tool_template import QWEN_TOOL_TEMPLATE

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
EXACT = {"ignore_eos": True}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "noop", "description": "does nothing"}},
]


@pytest.fixture(scope="module")
def tools_checkpoint(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tools") / "demo-tools"
    directory.mkdir()
    for path in demo_checkpoint.iterdir():
        (directory / path.name).symlink_to(path)
    (directory / "chat_template.jinja").write_text(QWEN_TOOL_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def server(tools_checkpoint: Path, tmp_path_factory) -> Iterator[LiveServer]:
    log_dir = tmp_path_factory.mktemp("server-log")
    # The demo's whole context window: the tool list alone takes ~270 tokens of the prompt.
    live = start_server(tools_checkpoint, log_dir, "--max-seq-len", "512")
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


def chat(client, server, stream=False, **kwargs):
    kwargs = {"max_tokens": 60, "temperature": 0, "messages": MESSAGES} | kwargs
    return client.chat.completions.create(model=server.model_id, stream=stream, **kwargs)


def _check_person(value: object) -> None:
    assert isinstance(value, dict) and set(value) == {"name", "age", "ok"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and isinstance(value["ok"], bool)


# --- logprobs -----------------------------------------------------------------------------------


def test_chat_logprobs(client, server):
    result = chat(client, server, max_tokens=8, logprobs=True, top_logprobs=3, extra_body=EXACT)
    choice = result.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == result.usage.completion_tokens == 8
    assert "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert bytes(e.bytes).decode() == e.token and e.logprob <= 0
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
    # greedy: the chosen token is the most likely one
    assert all(e.token == e.top_logprobs[0].token for e in entries)
    streamed = chat(
        client, server, True, max_tokens=8, logprobs=True, top_logprobs=3, extra_body=EXACT
    )
    streamed_entries = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # The same request again: its prompt now comes from the prefix cache, whose prefill of the
    # last token rounds float32 logits in the last bits unlike the whole prompt's (README).
    assert [e.token for e in streamed_entries] == [e.token for e in entries]
    assert [e.logprob for e in streamed_entries] == pytest.approx(
        [e.logprob for e in entries], abs=1e-5
    )


def test_chat_without_logprobs_has_none(client, server):
    assert chat(client, server, max_tokens=4).choices[0].logprobs is None


def test_completion_logprobs(client, server):
    kwargs = {"model": server.model_id, "prompt": "def f(x):", "max_tokens": 6, "temperature": 0}
    result = client.completions.create(logprobs=2, extra_body=EXACT, **kwargs)
    choice = result.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    assert all(
        len(top) == 2 and max(top.values()) == lp
        for top, lp in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    chunks = list(client.completions.create(logprobs=2, extra_body=EXACT, stream=True, **kwargs))
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    offsets = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.text_offset
    ]
    assert (tokens, offsets) == (lp.tokens, lp.text_offset)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
    ],
)
def test_bad_chat_logprobs_are_refused(server, body, param):
    status, reply = server.post(
        "/v1/chat/completions", {"model": server.model_id, "messages": MESSAGES, **body}
    )
    assert status == 400 and reply["error"]["param"] == param, reply


def test_completion_logprobs_above_5_are_refused(server):
    body = {"model": server.model_id, "prompt": "x", "logprobs": 6}
    status, reply = server.post("/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == "logprobs", reply


# --- response_format ----------------------------------------------------------------------------


def test_json_object(client, server):
    result = chat(client, server, response_format={"type": "json_object"})
    assert result.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(result.choices[0].message.content), dict)


def test_json_schema_whole_and_streamed(client, server):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    result = chat(client, server, response_format=fmt)
    content = result.choices[0].message.content
    _check_person(json.loads(content))
    streamed = chat(client, server, True, response_format=fmt)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content


def test_completion_response_format(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    result = client.completions.create(
        model=server.model_id,
        prompt="A person as JSON:",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    _check_person(json.loads(result.choices[0].text))


def test_the_client_parses_into_a_pydantic_model(client, server):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int
        ok: bool

    result = client.chat.completions.parse(
        model=server.model_id,
        messages=MESSAGES,
        response_format=Person,
        max_tokens=60,
        temperature=0,
    )
    assert isinstance(result.choices[0].message.parsed, Person)


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
            "response_format.json_schema.schema",
        ),
        ({"type": "json_schema"}, "response_format"),
        ({"type": "yaml"}, "response_format.type"),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "format": "weird"}},
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_response_formats_are_refused(server, fmt, param):
    body = {"model": server.model_id, "messages": MESSAGES, "response_format": fmt}
    status, reply = server.post("/v1/chat/completions", body)
    assert status == 400 and reply["error"]["param"] == param, reply


# --- tools --------------------------------------------------------------------------------------


def _check_weather_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "days"} and isinstance(arguments["days"], int)


def _assemble(chunks) -> tuple[str, dict[int, dict], str | None]:
    """What a client assembles from a stream: content, tool calls by index, finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += (part.function.name or "") if part.function else ""
            call["arguments"] += (part.function.arguments or "") if part.function else ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("messages", [MESSAGES, [{"role": "user", "content": "def f(x):"}]])
def test_tool_choice_required(client, server, messages):
    kwargs = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    result = chat(client, server, messages=messages, max_tokens=100, **kwargs)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    ((call),) = choice.message.tool_calls
    assert call.function.name in {"get_weather", "noop"}
    if call.function.name == "get_weather":
        _check_weather_call(call)
    content, calls, finish = _assemble(
        chat(client, server, True, messages=messages, max_tokens=100, **kwargs)
    )
    assert (content, finish) == ("", "tool_calls")
    ((streamed),) = calls.values()
    assert (streamed["name"], streamed["arguments"]) == (
        call.function.name,
        call.function.arguments,
    )


def test_named_tool_choice(client, server):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    result = chat(client, server, max_tokens=100, tools=TOOLS, tool_choice=choice)
    (call,) = result.choices[0].message.tool_calls
    _check_weather_call(call)


def test_tool_history_is_rendered(client, server, tools_checkpoint):
    calls = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    result = chat(client, server, messages=messages, max_tokens=4, tools=TOOLS)
    tokenizer = Tokenizer.from_dir(tools_checkpoint)
    template_messages = [dict(m) for m in messages[:2]] + [messages[2]]
    template_messages[1] = {
        **messages[1],
        "tool_calls": [
            {
                **calls[0],
                "function": {**calls[0]["function"], "arguments": {"city": "Paris", "days": 1}},
            }
        ],
    }
    text = tokenizer.apply_chat_template(template_messages, tools=TOOLS)
    assert "<tool_response>\nsunny" in text
    assert result.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_tool_choice_none_is_plain_text(client, server):
    result = chat(client, server, max_tokens=6, tools=TOOLS, tool_choice="none", extra_body=EXACT)
    assert result.choices[0].message.tool_calls is None
    assert result.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_tool_requests_are_refused(server, body, param):
    status, reply = server.post(
        "/v1/chat/completions", {"model": server.model_id, "messages": MESSAGES, **body}
    )
    assert status == 400 and reply["error"]["param"] == param, reply
