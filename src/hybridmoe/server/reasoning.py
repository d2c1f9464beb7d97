"""Reasoning: the text a model writes before its answer, split out of the generated text (whole or
streamed) so that chat replies carry it as `reasoning_content`, as vLLM and SGLang do.

A `ReasoningFormat` is registered in REASONING_FORMATS under its syntax's name and says whether a
chat template speaks it (`detects`); `--reasoning-format auto` picks the first that detects the
checkpoint's template. The whole-text parse is the streaming parser fed the whole text at once,
so a streamed reply always assembles to the non-streamed one, however the deltas are cut: text
that might still become a marker is held back until decided, so no part of one reaches content.

Harmony is parsed by hand, not with the `openai-harmony` package: that package works on token ids
of its own o200k vocabulary, which it downloads on first use (this server has no network, and a
GGUF's tokenizer or a test's has other ids), and the format is a handful of markers. Those
markers are special tokens of gpt-oss's vocabulary, so this format decodes with special tokens
kept (`keeps_special_tokens`): the parser then reads the exact token sequence as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.tokenizer import Tokenizer
from hybridmoe.registry import registering
from hybridmoe.server.tools import ToolCall, pending_prefix_len


@dataclass(frozen=True)
class Reasoning:
    """A piece of the reply's reasoning (harmony's analysis channel, a <think> block)."""

    text: str


Piece = str | Reasoning | ToolCall  # content, reasoning, or one complete tool call (harmony's)


class ReasoningStream(Protocol):
    def feed(self, text: str) -> list[Piece]:
        """Pieces the generated `text` (the next delta) decides, in order; none empty."""
        ...

    def finish(self) -> list[Piece]:
        """Pieces left at the end of generation (held-back text is decided now)."""
        ...


class ReasoningFormat(Protocol):
    name: str
    keeps_special_tokens: bool  # its markers are special tokens: decode without skipping them
    stop_tokens: tuple[str, ...]  # tokens that end a reply, besides the checkpoint's EOS

    def detects(self, template_source: str) -> bool:
        """True when a chat template writes (and so asks the model for) this syntax."""
        ...

    def stream(self, prompt: str) -> ReasoningStream:
        """A parser for one reply to `prompt` (the rendered chat, which may open the block)."""
        ...


REASONING_FORMATS: dict[str, ReasoningFormat] = {}
AUTO, NONE = "auto", "none"


def select_reasoning_format(choice: str, template_source: str) -> ReasoningFormat | None:
    """The format `choice` names ("auto": the first registered one the template speaks; "none":
    no reasoning is split out). ValueError naming the choices for anything else."""
    if choice == NONE:
        return None
    if choice == AUTO:
        return next((f for f in REASONING_FORMATS.values() if f.detects(template_source)), None)
    if choice not in REASONING_FORMATS:
        names = ", ".join([AUTO, NONE, *REASONING_FORMATS])
        raise ValueError(f"reasoning_format must be one of {names}; got {choice!r}")
    return REASONING_FORMATS[choice]


def resolve_reasoning(
    tokenizer: Tokenizer | None, choice: str
) -> tuple[ReasoningFormat | None, frozenset[int]]:
    """The format `choice` selects for the tokenizer's chat template, and the ids of that
    format's stop tokens. CheckpointError when the vocabulary lacks one of them (a format that
    does not fit the checkpoint)."""
    template = tokenizer.chat_template if tokenizer is not None else None
    reasoning = select_reasoning_format(choice, template.source if template else "")
    if reasoning is None:
        return None, frozenset()
    ids = set()
    for token in reasoning.stop_tokens:
        token_id = tokenizer.backend.token_to_id(token) if tokenizer is not None else None
        if token_id is None:
            raise CheckpointError(
                f"reasoning format {reasoning.name!r} ends replies with the token {token!r}, "
                "which this checkpoint's tokenizer does not have (see --reasoning-format)"
            )
        ids.add(token_id)
    return reasoning, frozenset(ids)


def _held_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    return max(pending_prefix_len(text, marker) for marker in markers)


# --- harmony -------------------------------------------------------------------------------------

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
_BODY_ENDS = (END, RETURN, CALL, START)  # START too: a message the model did not <|end|>
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."


@dataclass(frozen=True)
class _Header:
    channel: str
    recipient: str | None

    @classmethod
    def parse(cls, header: str) -> _Header:
        channel, recipient = _CHANNEL_NAME.search(header), _RECIPIENT.search(header)
        return cls(channel.group(1) if channel else "final", recipient and recipient.group(1))

    @property
    def call_name(self) -> str | None:
        """The function a `to=functions.NAME` message calls; None for other messages."""
        recipient = self.recipient or ""
        return recipient[len(FUNCTIONS) :] if recipient.startswith(FUNCTIONS) else None

    def piece(self, text: str) -> Piece:
        """`final` and `commentary` (the preamble users see) are content; the rest (other
        channels, messages to a built-in tool such as `to=python`) reasoning."""
        for_user = self.recipient is None and self.channel in ("final", "commentary")
        return text if for_user else Reasoning(text)


class HarmonyStream:
    """gpt-oss's messages: `[<|start|>assistant]<|channel|>NAME[ to=RECIPIENT][ <|constrain|>TYPE]
    <|message|>BODY<|end|>`, the last one ended by the stop token `<|return|>` or `<|call|>`
    instead. Channel `analysis` is reasoning, `final` content, `commentary` to=functions.NAME a
    tool call (its body the JSON arguments; a body that is no JSON object stays content).
    Headers are held until `<|message|>`; text left without one at the end (a reply not in
    harmony) is content, verbatim."""

    def __init__(self) -> None:
        self._buffer = ""  # undecided text: a header, or the body of a tool call
        self._header: _Header | None = None  # None: reading a header

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        pieces = self._drain(final=True)
        rest, self._buffer = self._buffer, ""
        if self._header is not None:  # cut off inside a body (max_tokens, or <|call|>)
            pieces += self._body(rest)
        elif rest.strip():
            pieces.append(rest)
        return [p for p in pieces if p]

    def _drain(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            if self._header is None:
                start = self._buffer.find(MESSAGE)
                if start < 0:
                    return pieces
                self._header = _Header.parse(self._buffer[:start])
                self._buffer = self._buffer[start + len(MESSAGE) :]
            end, marker = _first_marker(self._buffer, _BODY_ENDS)
            if end < 0:
                if self._header.call_name is None:  # a call is whole or nothing: wait for it
                    keep = 0 if final else _held_len(self._buffer, _BODY_ENDS)
                    pieces += self._body(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                return pieces
            pieces += self._body(self._buffer[:end])
            skip = 0 if marker == START else len(marker)  # START begins the next header
            self._buffer, self._header = self._buffer[end + skip :], None

    def _body(self, text: str) -> list[Piece]:
        header = self._header
        if not text or header is None:
            return []
        if header.call_name is None:
            return [header.piece(text)]
        try:
            arguments = json.loads(text)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            return [text]
        return [ToolCall(header.call_name, json.dumps(arguments, ensure_ascii=False))]


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(index, marker) of the earliest of `markers` in `text`; (-1, "") when none is."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, "")


@registering(REASONING_FORMATS, "reasoning format", "harmony")
class HarmonyReasoning:
    """gpt-oss's harmony format: an `analysis` channel of reasoning, then the `final` answer."""

    name = "harmony"
    keeps_special_tokens = True
    stop_tokens = (RETURN, CALL)

    @staticmethod
    def detects(template_source: str) -> bool:
        return CHANNEL in template_source

    @staticmethod
    def stream(prompt: str) -> ReasoningStream:
        return HarmonyStream()


# --- <think> ---------------------------------------------------------------------------------


class ThinkStream:
    """`<think>reasoning</think>answer`. A reply whose prompt ends in an open `<think>` (DeepSeek-R1
    and Qwen3-Thinking templates) starts inside the block; otherwise the block counts only at
    the reply's start (after whitespace), and a reply without one is all content, verbatim.
    Reasoning is stripped of surrounding whitespace, the answer of the whitespace after
    `</think>`; a reply cut off inside the block is all reasoning."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, thinking: bool) -> None:
        self._state = "thinking" if thinking else "start"  # -> "thinking" -> "answer"
        self._buffer = ""  # undecided text
        self._reasoning_started = False  # leading whitespace of the reasoning is dropped
        self._trim_answer = False  # the answer's leading whitespace (after </think>) is dropped

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(self.OPEN):
                self._buffer, self._state = head[len(self.OPEN) :], "thinking"
            elif self.OPEN.startswith(head) and not final:
                return pieces  # still possibly `<think>` (or only whitespace so far)
            else:
                self._state = "answer"
        if self._state == "thinking":
            pieces += self._reasoning(final)
        if self._state == "answer":
            pieces += self._answer()
        return pieces

    def _reasoning(self, final: bool) -> list[Piece]:
        end = self._buffer.find(self.CLOSE)
        if end >= 0:
            text, self._buffer = self._buffer[:end].rstrip(), self._buffer[end + len(self.CLOSE) :]
            self._state, self._trim_answer = "answer", True
        elif final:
            text, self._buffer = self._buffer.rstrip(), ""
        else:  # hold back a possible `</think>` and the whitespace that may precede it
            keep = pending_prefix_len(self._buffer, self.CLOSE)
            text = self._buffer[: len(self._buffer) - keep].rstrip()
            self._buffer = self._buffer[len(text) :]
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        return [Reasoning(text)] if text else []

    def _answer(self) -> list[Piece]:
        text, self._buffer = self._buffer, ""
        if self._trim_answer:
            text = text.lstrip()
            self._trim_answer = not text
        return [text] if text else []


@registering(REASONING_FORMATS, "reasoning format", "think")
class ThinkReasoning:
    """Qwen3, DeepSeek-R1 and the like: reasoning inside `<think>...</think>` before the answer."""

    name = "think"
    keeps_special_tokens = False  # `<think>` is a plain (non-special) token in these vocabularies
    stop_tokens: tuple[str, ...] = ()

    @staticmethod
    def detects(template_source: str) -> bool:
        return ThinkStream.OPEN in template_source

    @staticmethod
    def stream(prompt: str) -> ReasoningStream:
        return ThinkStream(thinking=prompt.rstrip().endswith(ThinkStream.OPEN))
