"""Turning a Generation's outputs into OpenAI response bodies: whole, or as server-sent events
(`data: <chunk JSON>` per event, `data: [DONE]` last)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from hybridmoe.server.errors import generation_error
from hybridmoe.server.generation import Generation
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


class _Ids:
    """What every body or chunk of one response repeats."""

    def __init__(self, prefix: str, model: str) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def fields(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}


async def collect(generation: Generation) -> tuple[str, str]:
    """(text, finish_reason) of a whole generation; raises its error."""
    pieces, finish_reason = [], ""
    async for output in generation.outputs():
        pieces.append(output.text)
        finish_reason = output.finish_reason or finish_reason
    return "".join(pieces), finish_reason


def _usage(generation: Generation) -> Usage:
    return Usage.of(
        generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens
    )


async def completion_body(generation: Generation, model: str) -> Completion:
    text, finish_reason = await collect(generation)
    choice = CompletionChoice(text=text, finish_reason=finish_reason)
    return Completion(**_Ids("cmpl", model).fields(), choices=[choice], usage=_usage(generation))


async def chat_body(generation: Generation, model: str) -> ChatCompletion:
    text, finish_reason = await collect(generation)
    message = AssistantMessage(content=text)
    choice = ChatChoice(message=message, finish_reason=finish_reason)
    return ChatCompletion(
        **_Ids("chatcmpl", model).fields(), choices=[choice], usage=_usage(generation)
    )


async def completion_chunks(
    generation: Generation, model: str, include_usage: bool
) -> AsyncIterator[BaseModel]:
    ids = _Ids("cmpl", model)
    async for output in generation.outputs():
        choice = CompletionChoice(text=output.text, finish_reason=output.finish_reason)
        yield Completion(**ids.fields(), choices=[choice])
    if include_usage:
        yield Completion(**ids.fields(), choices=[], usage=_usage(generation))


async def chat_chunks(
    generation: Generation, model: str, include_usage: bool
) -> AsyncIterator[BaseModel]:
    ids = _Ids("chatcmpl", model)

    def chunk(delta: dict[str, str], finish_reason: str | None = None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(**ids.fields(), choices=[choice])

    yield chunk({"role": "assistant", "content": ""})
    async for output in generation.outputs():
        if output.text:
            yield chunk({"content": output.text})
        if output.finish_reason:
            yield chunk({}, output.finish_reason)
    if include_usage:
        yield ChatCompletionChunk(**ids.fields(), choices=[], usage=_usage(generation))


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
