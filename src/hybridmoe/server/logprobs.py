"""Engine TokenLogprobs in OpenAI's response shapes: chat's `logprobs.content[]` and the legacy
completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.

A token's text is its bytes (from the vocabulary) decoded as UTF-8, U+FFFD standing for a
partial character; chat's `bytes` are the exact bytes. There is one entry per generated token,
EOS included, so a stop string's tokens are listed although the text leaves it out; `text_offset`
counts the characters of the tokens before it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from hybridmoe.engine.logprobs import TokenLogprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports the same floor


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TokenText:
    """Token id -> (text, bytes), over one checkpoint's vocabulary."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self._bytes = token_bytes

    def bytes_of(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def text_of(self, token_id: int) -> str:
        return self._bytes[token_id].decode("utf-8", errors="replace")


def _floor(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _top(vocab: TokenText, token_id: int, logprob: float) -> TopLogprob:
    return TopLogprob(
        token=vocab.text_of(token_id), logprob=_floor(logprob), bytes=list(vocab.bytes_of(token_id))
    )


def chat_logprobs(entries: Sequence[TokenLogprob], vocab: TokenText) -> ChatLogprobs:
    content = [
        ChatTokenLogprob(
            **_top(vocab, e.token_id, e.logprob).model_dump(),
            top_logprobs=[_top(vocab, i, lp) for i, lp in e.top],
        )
        for e in entries
    ]
    return ChatLogprobs(content=content)


def completion_logprobs(
    entries: Sequence[TokenLogprob], vocab: TokenText, first_offset: int = 0
) -> CompletionLogprobs:
    """`first_offset`: the text offset of the first entry (a stream's earlier tokens)."""
    tokens = [vocab.text_of(e.token_id) for e in entries]
    offsets, offset = [], first_offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[_floor(e.logprob) for e in entries],
        top_logprobs=[{vocab.text_of(i): _floor(lp) for i, lp in e.top} for e in entries],
        text_offset=offsets,
    )
