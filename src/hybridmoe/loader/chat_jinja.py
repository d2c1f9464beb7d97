"""The jinja side of chat templates (chat_template.py): the immutable sandbox with the globals,
filters and environment options `transformers` gives a template, and the compiled templates.
Imported on a template's first render, so that loading a model does not load jinja."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hybridmoe.errors import CheckpointError

__all__ = ["TemplateError", "compile_template"]


@lru_cache(maxsize=16)
def compile_template(source: str, origin: str) -> jinja2.Template:
    """`source` compiled in the sandbox (cached); CheckpointError naming `origin` if it does not
    compile."""
    try:
        return _ENVIRONMENT.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"{origin}: chat template does not compile: {e}") from e


def _raise_exception(message: str) -> None:
    # The template's own check on the conversation, e.g. "roles must alternate user/assistant".
    raise ValueError(f"chat template rejected the conversation: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML and takes no options; templates expect this.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _DictFactory:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the `dict` type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _PublicNamespace(jinja2.utils.Namespace):
    """jinja's `namespace()` refusing underscore names, which could reach interpreter internals."""

    def __init__(self, /, *args: Any, **kwargs: Any) -> None:
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_public(name)
        super().__init__(attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_public(name)
        super().__setitem__(name, value)


def _check_public(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for
    inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the `generation` name itself
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _create_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _PublicNamespace
    return env


_ENVIRONMENT = _create_environment()
