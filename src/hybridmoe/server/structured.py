"""Chat requests' `response_format`, `tools` and `tool_choice`: their wire format, and the plan
they make for a generation (what the chat template gets, which grammar constrains the output,
which tool-call syntax is parsed out of it).

`response_format` json_object / json_schema and `tool_choice` "required" / a named function are
enforced by grammar-constrained decoding; json_schema's `strict` false is enforced all the same.
`tool_choice` "none" leaves the tools out of the prompt, so the model is not offered them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hybridmoe.engine.constraints import Grammar, GrammarError
from hybridmoe.server.errors import ApiError
from hybridmoe.server.tools import ToolCallFormat, ToolCallParsing, ToolSpec, format_for_template

_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type json_schema, and only then")
        return self

    @property
    def grammar_param(self) -> str:
        """The field a grammar error is reported under."""
        schema = self.type == "json_schema"
        return "response_format.json_schema.schema" if schema else "response_format"

    def grammar(self) -> Grammar | None:
        if self.type == "json_object":
            return Grammar("json_object")
        if self.type == "json_schema":
            return Grammar.json_schema(self.json_schema.json_schema or {"type": "object"})
        return None


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef

    def spec(self) -> ToolSpec:
        return ToolSpec(self.function.name, self.function.parameters or _NO_PARAMETERS)


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    """A call as OpenAI writes it, in an assistant message or a response."""

    name: str
    arguments: str  # a JSON object, as text

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, arguments: str) -> str:
        try:
            json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments must be JSON text: {e}") from e
        return arguments


class MessageToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request's format and tools ask of its generation."""

    template_tools: list[dict[str, Any]] | None  # the chat template's `tools`
    grammar: Grammar | None
    grammar_param: str | None  # the request field a grammar error is reported under
    tool_parsing: ToolCallParsing | None  # how tool calls are parsed out of the output


def plan_chat(
    response_format: ResponseFormat | None,
    tools: list[ToolDef] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool,
    template_source: str,
) -> ChatPlan:
    """The plan of a validated request (tool_choice names one of `tools`); ApiError 400 when
    the checkpoint's template cannot offer tools or no registered syntax parses its calls."""
    choice = tool_choice or ("auto" if tools else "none")
    if not tools or choice == "none":
        if response_format is None:
            return ChatPlan(None, None, None, None)
        return ChatPlan(None, response_format.grammar(), response_format.grammar_param, None)
    fmt = _tool_format(template_source)
    specs = [tool.spec() for tool in tools]
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    parsing = ToolCallParsing(fmt, parallel_tool_calls)
    if choice == "auto":
        return ChatPlan(template_tools, None, None, parsing)
    if choice == "required":
        grammar = _enforced(fmt, specs, parallel_tool_calls)
        return ChatPlan(template_tools, grammar, "tools", parsing)
    named = [s for s in specs if s.name == choice.function.name]
    grammar = _enforced(fmt, named, parallel=False)
    return ChatPlan(template_tools, grammar, "tool_choice", ToolCallParsing(fmt, parallel=False))


def _enforced(fmt: ToolCallFormat, specs: list[ToolSpec], parallel: bool) -> Grammar:
    try:
        return fmt.grammar(specs, parallel)
    except GrammarError as exc:
        raise ApiError(400, str(exc), param="tool_choice") from exc


def _tool_format(template_source: str) -> ToolCallFormat:
    if "tools" not in template_source:
        raise ApiError(400, "this checkpoint's chat template does not render tools", param="tools")
    fmt = format_for_template(template_source)
    if fmt is None:
        raise ApiError(
            400,
            "this server has no parser for the tool-call syntax of this checkpoint's chat "
            "template (known: see server/tools.py TOOL_CALL_FORMATS)",
            param="tools",
        )
    return fmt
