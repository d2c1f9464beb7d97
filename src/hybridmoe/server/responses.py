"""Turning a Generation's outputs into OpenAI response bodies: whole, or as server-sent events
(`data: <chunk JSON>` per event, `data: [DONE]` last)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from hybridmoe.engine.logprobs import TokenLogprob
from hybridmoe.engine.scheduler import RequestOutput
from hybridmoe.server.errors import generation_error
from hybridmoe.server.generation import Generation
from hybridmoe.server.logprobs import ChatLogprobs, chat_logprobs, completion_logprobs
from hybridmoe.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Usage,
)
from hybridmoe.server.reasoning import Reasoning
from hybridmoe.server.reply import parse_reply
from hybridmoe.server.structured import FunctionCall, ResponseToolCall
from hybridmoe.server.tools import ToolCall


class _Ids:
    """What every body or chunk of one response repeats."""

    def __init__(self, prefix: str, model: str) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def fields(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}


async def collect(generation: Generation) -> tuple[str, str, list[TokenLogprob]]:
    """(text, finish_reason, logprobs) of a whole generation; raises its error."""
    pieces, finish_reason, logprobs = [], "", []
    async for output in generation.outputs():
        pieces.append(output.text)
        logprobs.extend(output.logprobs)
        finish_reason = output.finish_reason or finish_reason
    return "".join(pieces), finish_reason, logprobs


def _tool_call(call: ToolCall) -> ResponseToolCall:
    function = FunctionCall(name=call.name, arguments=call.arguments)
    return ResponseToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=function)


def _finish_reason(finish_reason: str, called_tools: bool) -> str:
    # A generation that stopped after its calls ends in them; one cut by length stays "length".
    return "tool_calls" if called_tools and finish_reason == "stop" else finish_reason


def _usage(generation: Generation) -> Usage:
    return Usage.of(
        generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens
    )


async def completion_body(generation: Generation, model: str) -> Completion:
    text, finish_reason, entries = await collect(generation)
    logprobs = completion_logprobs(entries, generation.vocab) if generation.vocab else None
    choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)
    return Completion(**_Ids("cmpl", model).fields(), choices=[choice], usage=_usage(generation))


async def chat_body(generation: Generation, model: str) -> ChatCompletion:
    text, finish_reason, entries = await collect(generation)
    reasoning, content, calls = None, text, []
    if generation.reply is not None:
        reasoning, content, calls = parse_reply(generation.reply, text)
    message = AssistantMessage(
        content=content,
        reasoning_content=reasoning,
        tool_calls=[_tool_call(c) for c in calls] or None,
    )
    logprobs = chat_logprobs(entries, generation.vocab) if generation.vocab else None
    reason = _finish_reason(finish_reason, bool(calls))
    choice = ChatChoice(message=message, logprobs=logprobs, finish_reason=reason)
    return ChatCompletion(
        **_Ids("chatcmpl", model).fields(), choices=[choice], usage=_usage(generation)
    )


async def completion_chunks(
    generation: Generation, model: str, include_usage: bool
) -> AsyncIterator[BaseModel]:
    ids = _Ids("cmpl", model)
    text_offset = 0
    async for output in generation.outputs():
        logprobs = None
        if generation.vocab is not None:
            logprobs = completion_logprobs(output.logprobs, generation.vocab, text_offset)
            text_offset += sum(map(len, logprobs.tokens))
        choice = CompletionChoice(
            text=output.text, logprobs=logprobs, finish_reason=output.finish_reason
        )
        yield Completion(**ids.fields(), choices=[choice])
    if include_usage:
        yield Completion(**ids.fields(), choices=[], usage=_usage(generation))


async def chat_chunks(
    generation: Generation, model: str, include_usage: bool
) -> AsyncIterator[BaseModel]:
    ids = _Ids("chatcmpl", model)

    def chunk(
        delta: dict[str, Any],
        finish_reason: str | None = None,
        logprobs: ChatLogprobs | None = None,
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return ChatCompletionChunk(**ids.fields(), choices=[choice])

    yield chunk({"role": "assistant", "content": ""})
    deltas = _ChatDeltas(generation)
    async for output in generation.outputs():
        logprobs = None
        pieces = deltas.of(output)
        if generation.vocab is not None and output.logprobs:
            logprobs = chat_logprobs(output.logprobs, generation.vocab)
            pieces = pieces or [{"content": ""}]  # the logprobs of tokens that print nothing
        for i, delta in enumerate(pieces):
            yield chunk(delta, logprobs=logprobs if i == 0 else None)
        if output.finish_reason:
            yield chunk({}, _finish_reason(output.finish_reason, deltas.calls > 0))
    if include_usage:
        yield ChatCompletionChunk(**ids.fields(), choices=[], usage=_usage(generation))


class _ChatDeltas:
    """The chunk deltas of each output: its text as content or, with reply parsing, the
    reasoning, content and tool calls its parser decides (`calls` counts those so far)."""

    def __init__(self, generation: Generation) -> None:
        parsing = generation.reply
        self._parser = parsing.stream() if parsing is not None else None
        self.calls = 0

    def of(self, output: RequestOutput) -> list[dict[str, Any]]:
        if self._parser is None:
            return [{"content": output.text}] if output.text else []
        events = self._parser.feed(output.text)
        events += self._parser.finish() if output.finished else []
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ToolCall):
                deltas += _tool_call_deltas(event, self.calls)
                self.calls += 1
            elif isinstance(event, Reasoning):
                deltas.append({"reasoning_content": event.text})
            else:
                deltas.append({"content": event})
        return deltas


def _tool_call_deltas(call: ToolCall, index: int) -> list[dict[str, Any]]:
    """As OpenAI streams a call: its id, type and name (empty arguments), then the arguments."""
    head = _tool_call(call).model_dump()
    head["function"]["arguments"] = ""
    arguments = {"index": index, "function": {"arguments": call.arguments}}
    return [{"tool_calls": [{"index": index, **head}]}, {"tool_calls": [arguments]}]


async def server_sent_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """`data:` events of `chunks`, then `data: [DONE]`. A generation that fails once the stream
    has begun (the status line is sent) ends with an error event, as OpenAI's streams do."""
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json()}\n\n"
    except Exception as exc:
        yield f"data: {json.dumps(generation_error(exc).body())}\n\n"
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """The server-sent events of `chunks`. However the response ends (done, client gone, server
    shutting down) its generation is cancelled at once, so a vanished client frees its KV row
    within a step instead of whenever the garbage collector gets to the generators."""

    def __init__(self, chunks: AsyncIterator[BaseModel], generation: Generation) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        events = server_sent_events(chunks)
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.cancel()
