"""A chat reply's generated text as the parts of its message: the reasoning split out first
(reasoning.py), then the tool calls parsed out of the content (tools.py); whole or streamed, the
whole parse being the stream fed the whole text at once."""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.server.reasoning import Piece, Reasoning, ReasoningFormat, ReasoningStream
from hybridmoe.server.tools import ToolCall, ToolCallParsing, ToolCallStream


@dataclass(frozen=True)
class ReplyParsing:
    """How one chat reply is parsed: reasoning in `reasoning`'s format (given the rendered
    `prompt` the reply continues), tool calls by `tools`; None: no such parsing."""

    reasoning: ReasoningFormat | None = None
    prompt: str = ""
    tools: ToolCallParsing | None = None

    def stream(self) -> ReplyStream:
        reasoning = self.reasoning.stream(self.prompt) if self.reasoning is not None else None
        return ReplyStream(reasoning, self.tools.stream() if self.tools is not None else None)


class ReplyStream:
    """Pieces (content, Reasoning, ToolCall) of a reply's text deltas; none empty."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self._reasoning, self._tools = reasoning, tools

    def feed(self, text: str) -> list[Piece]:
        return self._with_calls(self._reasoning.feed(text) if self._reasoning else [text])

    def finish(self) -> list[Piece]:
        pieces = self._with_calls(self._reasoning.finish() if self._reasoning else [])
        return pieces + (self._tools.finish() if self._tools is not None else [])

    def _with_calls(self, pieces: list[Piece]) -> list[Piece]:
        if self._tools is None:
            return [piece for piece in pieces if piece]
        parsed: list[Piece] = []
        for piece in pieces:
            parsed += self._tools.feed(piece) if isinstance(piece, str) else [piece]
        return parsed


def parse_reply(parsing: ReplyParsing, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning, content, tool calls) of a whole reply; None for an empty part."""
    stream = parsing.stream()
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    content = "".join(p for p in pieces if isinstance(p, str))
    return reasoning or None, content or None, [p for p in pieces if isinstance(p, ToolCall)]
