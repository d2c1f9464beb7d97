"""The OpenAI wire format this server speaks: request bodies (validated) and response bodies.

Requests are parsed strictly (a string where a number belongs is an error, as in OpenAI's
API). Fields this server does not implement are refused unless they hold their neutral value,
so a request never silently runs differently from what it asked for; unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hybridmoe.server.errors import LONE_SURROGATE
from hybridmoe.server.text import lone_surrogate_path

_MAX_SEED = 2**64
# Values of the unimplemented /v1/completions fields that ask for nothing.
_COMPLETION_NEUTRAL = {
    "echo": (False,),
    "logprobs": (None,),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields /v1/completions and /v1/chat/completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # 0 = greedy, as OpenAI
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=_MAX_SEED)
    # Extensions, spelled as vLLM spells them.
    top_k: int = Field(0, ge=0)  # 0 = off
    ignore_eos: bool = False  # generate max_tokens tokens even past EOS (benchmarks)
    # Not implemented: accepted only at their neutral value.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        path = lone_surrogate_path(body)
        if path is not None:
            raise PydanticCustomError(
                LONE_SURROGATE,
                "contains a lone UTF-16 surrogate (not a Unicode character; send valid UTF-8)",
                {"param": path or None},
            )
        return body

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: Any) -> Any:
        strings = [stop] if isinstance(stop, str) else stop
        if stop is not None and not (
            isinstance(strings, list) and all(isinstance(s, str) and s for s in strings)
        ):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        return stop

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported; leave it at 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_or_ids(cls, prompt: Any) -> Any:
        is_ids = isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        )
        if not (isinstance(prompt, str) or is_ids) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        return prompt

    @field_validator("echo", "logprobs", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        # Strict parsing has already checked the type, so `in` cannot confuse True with 1.
        if value not in _COMPLETION_NEUTRAL[info.field_name]:
            raise ValueError("not supported by this server")
        return value


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (name, reasoning_content, ...) go to the chat template as they came.
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[ContentPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, content: Any) -> Any:
        parts_ok = isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        )
        if not (content is None or isinstance(content, str) or parts_ok):
            raise ValueError('content must be a string or a list of {"type": "text", "text": ...}')
        return content

    def template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("logprobs", "tools")
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value:
            raise ValueError("not supported by this server")
        return value

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# --- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A whole completion, and also each streamed chunk of one (OpenAI uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role": ...} first, then {"content": ...}, {} with finish_reason
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hybridmoe"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
