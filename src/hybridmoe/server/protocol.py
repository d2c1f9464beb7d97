"""The OpenAI wire format this server speaks: request bodies (validated) and response bodies.

Requests are parsed strictly (a string where a number belongs is an error, as in OpenAI's
API). Fields this server does not implement are refused unless they hold their neutral value,
so a request never silently runs differently from what it asked for; unknown fields are ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hybridmoe.engine.logprobs import MAX_TOP_LOGPROBS
from hybridmoe.loader.chat_template import SPECIAL_TOKEN_NAMES
from hybridmoe.server.errors import LONE_SURROGATE
from hybridmoe.server.logprobs import ChatLogprobs, CompletionLogprobs
from hybridmoe.server.structured import (
    MessageToolCall,
    NamedToolChoice,
    ResponseFormat,
    ResponseToolCall,
    ToolChoice,
    ToolDef,
)
from hybridmoe.server.text import lone_surrogate_path

_MAX_SEED = 2**64
# What the server itself gives a chat template; chat_template_kwargs cannot set these.
_TEMPLATE_OWN_NAMES = {
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    *SPECIAL_TOKEN_NAMES,
}
# Values of the unimplemented /v1/completions fields that ask for nothing.
_COMPLETION_NEUTRAL = {
    "echo": (False,),
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
    logprobs: int | None = Field(None, ge=0, le=5)  # top alternatives per token, as OpenAI's
    response_format: ResponseFormat | None = None  # an extension, as vLLM's
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

    @field_validator("echo", "best_of", "suffix")
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
    # Extra keys (name, tool_call_id, reasoning_content, ...) go to the chat template as they came.
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, earlier in the chat

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
        for call in message.get("tool_calls", []):
            # Templates write arguments with `tojson` (or as is when a string): give the object.
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = Field(None, min_length=1)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # Reaches the chat template as its `reasoning_effort` variable (gpt-oss's "Reasoning: high");
    # left undefined there when not given, so the template's own default holds.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # Further chat template variables, as vLLM and SGLang take them (Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's deprecated spelling of tools: refused, so that it is not quietly ignored.
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_templates_own(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or {}) & _TEMPLATE_OWN_NAMES)
        if taken:
            raise ValueError(f"{taken} are set by the server (use messages, tools, ...)")
        return kwargs

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("not supported by this server; use tools and tool_choice")
        return value

    # Each check below reads fields declared above it (pydantic validates in that order).
    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, choice: Any) -> Any:
        if isinstance(choice, dict) or choice in (None, "none", "auto", "required"):
            return choice
        raise ValueError('tool_choice must be "none", "auto", "required" or a named function')

    @field_validator("tool_choice")
    @classmethod
    def _one_of_the_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if choice is not None and choice != "none" and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {tool.function.name for tool in tools}:
                raise ValueError(f"no tool is named {choice.function.name!r}")
        return choice

    @field_validator("response_format")
    @classmethod
    def _not_with_tools(cls, value: ResponseFormat | None, info: ValidationInfo) -> Any:
        tools_on = info.data.get("tools") and info.data.get("tool_choice") != "none"
        if value is not None and value.type != "text" and tools_on:
            raise ValueError(
                'a JSON response_format cannot go with tools (unless tool_choice is "none")'
            )
        return value

    @property
    def top_logprobs_count(self) -> int | None:
        """SamplingParams.logprobs: None when no logprobs are asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def template_variables(self) -> dict[str, Any]:
        """The chat template's variables beyond messages and tools (reasoning_effort over the
        same name in chat_template_kwargs)."""
        effort = self.reasoning_effort
        return (self.chat_template_kwargs or {}) | (
            {} if effort is None else {"reasoning_effort": effort}
        )


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
    logprobs: CompletionLogprobs | None = None
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
    content: str | None
    # The reply's reasoning (reasoning.py), as vLLM and SGLang name it; None without any.
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    # {"role": ...} first, then {"content": ...}, {"reasoning_content": ...} or
    # {"tool_calls": [...]}, and {} with the finish_reason
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
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
