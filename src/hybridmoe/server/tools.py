"""Tool calls: each model family's tool-call syntax, parsed out of the generated text (whole or
streamed) and, for `tool_choice: "required"` or a named function, enforced by a grammar.

A `ToolCallFormat` is registered in TOOL_CALL_FORMATS under its family's name and says whether a
chat template speaks it (`detects`); the server picks the first format that detects the
checkpoint's template. The whole-text parse is the streaming parser fed the whole text at once,
so a streamed response always assembles to the non-streamed one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hybridmoe.engine.constraints import JSON_OPTIONS, Grammar, GrammarError
from hybridmoe.registry import registering


@dataclass(frozen=True)
class ToolSpec:
    """One function the request offers: its name and its parameters' JSON schema."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it: text, not a dict


Event = str | ToolCall  # a piece of message content, or one complete tool call


class ToolCallStream(Protocol):
    def feed(self, text: str) -> list[Event]:
        """Events the generated `text` (the next delta) completes, in order."""
        ...

    def finish(self) -> list[Event]:
        """Events left at the end of generation (held-back text becomes content)."""
        ...


class ToolCallFormat(Protocol):
    name: str

    def detects(self, template_source: str) -> bool:
        """True when a chat template writes (and so asks the model for) this syntax."""
        ...

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> Grammar:
        """Output that is one tool call (or several, when `parallel`) to one of `tools`, each
        with arguments valid for that tool's parameters schema; GrammarError when the syntax
        cannot be enforced."""
        ...

    def stream(self) -> ToolCallStream: ...


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {}


def format_for_template(template_source: str) -> ToolCallFormat | None:
    """The registered format the chat template speaks, or None."""
    return next((f for f in TOOL_CALL_FORMATS.values() if f.detects(template_source)), None)


@dataclass(frozen=True)
class ToolCallParsing:
    """How one response's calls are parsed: in `format`'s syntax, and with `parallel` false
    only the first call is kept (OpenAI's parallel_tool_calls: false, which tool_choice auto
    cannot enforce while generating; "required" and a named function enforce it by grammar)."""

    format: ToolCallFormat
    parallel: bool = True

    def stream(self) -> ToolCallStream:
        stream = self.format.stream()
        return stream if self.parallel else _FirstCallOnly(stream)


class _FirstCallOnly:
    def __init__(self, stream: ToolCallStream) -> None:
        self._stream, self._called = stream, False

    def feed(self, text: str) -> list[Event]:
        return self._keep(self._stream.feed(text))

    def finish(self) -> list[Event]:
        return self._keep(self._stream.finish())

    def _keep(self, events: list[Event]) -> list[Event]:
        kept = []
        for event in events:
            if isinstance(event, ToolCall):
                if self._called:
                    continue
                self._called = True
            kept.append(event)
        return kept


def parse_tool_calls(
    parsing: ToolCallParsing | ToolCallFormat, text: str
) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole generated text; content None when there is none."""
    stream = parsing.stream()
    events = stream.feed(text) + stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content or None, [e for e in events if isinstance(e, ToolCall)]


class TaggedJsonStream:
    """Calls written as `<open>{"name": ..., "arguments": {...}}<close>` between free text.
    Content is the text outside the calls with leading and trailing whitespace dropped: text
    that might still become `<open>` and whitespace that might be trailing are held back until
    decided. A block that is not such a JSON object stays content, as the model wrote it."""

    def __init__(self, open_tag: str, close_tag: str) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self._buffer = ""  # undecided text: a possible `<open>` prefix, or an unclosed call
        self._in_call = False
        self._held_space = ""  # whitespace after the last content, emitted if content follows
        self._started = False  # some content was emitted (leading whitespace is dropped)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return list(self._drain())

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        events = self._content(rest)
        self._held_space = ""  # trailing whitespace is dropped
        return events

    def _drain(self) -> Iterator[Event]:
        while True:
            if self._in_call:
                end = self._buffer.find(self.close_tag)
                if end < 0:
                    return
                block = self._buffer[: end + len(self.close_tag)]
                self._buffer, self._in_call = self._buffer[len(block) :], False
                yield from self._call_or_content(block)
            else:
                start = self._buffer.find(self.open_tag)
                if start < 0:
                    keep = pending_prefix_len(self._buffer, self.open_tag)
                    cut = len(self._buffer) - keep
                    yield from self._content(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    return
                yield from self._content(self._buffer[:start])
                self._buffer, self._in_call = self._buffer[start:], True

    def _call_or_content(self, block: str) -> list[Event]:
        inner = block[len(self.open_tag) : -len(self.close_tag)]
        call = _json_call(inner)
        return [call] if call is not None else self._content(block)

    def _content(self, text: str) -> list[Event]:
        stripped = text.rstrip()
        if not stripped:
            self._held_space += text if self._started else ""
            return []
        out = (self._held_space if self._started else "") + (
            stripped if self._started else stripped.lstrip()
        )
        self._held_space, self._started = text[len(stripped) :], True
        return [out]


def pending_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _json_call(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


@registering(TOOL_CALL_FORMATS, "tool-call format", "qwen")
class QwenToolCalls:
    """Qwen2/Qwen3 (Hermes-style): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    one block per call; its templates list the tools inside `<tools></tools>`."""

    name = "qwen"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    @classmethod
    def detects(cls, template_source: str) -> bool:
        return cls.OPEN in template_source

    @classmethod
    def grammar(cls, tools: Sequence[ToolSpec], parallel: bool) -> Grammar:
        calls = [_call_schema(tool) for tool in tools]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {**schema, "x-guidance": JSON_OPTIONS}  # compact JSON, as for response_format
        call = f'"{cls.OPEN}\\n" %json {json.dumps(schema)} "\\n{cls.CLOSE}"'
        start = 'call ("\\n" call)*' if parallel else "call"
        return Grammar("lark", f"start: {start}\ncall: {call}\n")

    @classmethod
    def stream(cls) -> ToolCallStream:
        return TaggedJsonStream(cls.OPEN, cls.CLOSE)


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


@registering(TOOL_CALL_FORMATS, "tool-call format", "harmony")
class HarmonyToolCalls:
    """gpt-oss (harmony): a call is a `commentary` message `to=functions.NAME`, ended by the stop
    token `<|call|>`, so one call per reply. Its markers are special tokens, which the harmony
    reasoning parser (reasoning.py) reads before this stage: content passes here unchanged.
    No grammar can write special tokens, so calls cannot be enforced."""

    name = "harmony"
    CALL = "<|call|>"  # how its templates end an assistant's call in the history

    @classmethod
    def detects(cls, template_source: str) -> bool:
        return cls.CALL in template_source

    @classmethod
    def grammar(cls, tools: Sequence[ToolSpec], parallel: bool) -> Grammar:
        raise GrammarError(
            'a harmony model\'s calls cannot be enforced (tool_choice "required" or a named '
            'function); use tool_choice "auto"'
        )

    @classmethod
    def stream(cls) -> ToolCallStream:
        return _ContentOnly()


class _ContentOnly:
    def feed(self, text: str) -> list[Event]:
        return [text] if text else []

    def finish(self) -> list[Event]:
        return []
