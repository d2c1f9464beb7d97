"""Chat templates: find a checkpoint's jinja template and render it exactly as `transformers` does.

Templates come from the Hub and are untrusted code, so they run in jinja's immutable sandbox with
the same globals, filters and environment options `transformers` gives them; a template that
renders there renders the same here. jinja itself loads on the first render (chat_jinja.py): a
checkpoint's template is read at load, compiled when a chat request first needs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridmoe.errors import CheckpointError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The named special tokens `transformers` passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning may come under; templates read `reasoning_content` or `thinking`.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja chat template, where it came from, and the special tokens it may refer to."""

    source: str
    origin: str  # names the file (and field) the template was read from, for error messages
    special_tokens: Mapping[str, str]  # e.g. {"eos_token": "<|im_end|>"}; unset tokens absent

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Render `messages` (and the `tools` offered, OpenAI's {"type": "function", ...} dicts,
        as transformers passes them) to the prompt text; modifies neither. `variables` are
        further names the template sees (transformers' extra keyword arguments, such as
        `reasoning_effort`); they cannot replace the ones above.

        Raises CheckpointError if the template does not compile, and ValueError if it rejects the
        messages (its `raise_exception`) or fails to render them.
        """
        from hybridmoe.loader.chat_jinja import TemplateError, compile_template

        compiled = compile_template(self.source, self.origin)
        context = {
            **{name: _plain_copy(value) for name, value in (variables or {}).items()},
            "messages": normalize_messages(messages),
            # None, not left undefined, when there are none: templates test `tools is not none`.
            "tools": [_plain_copy(tool) for tool in tools] if tools else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **self.special_tokens,
        }
        try:
            return compiled.render(context)
        except TemplateError as e:
            raise ValueError(f"chat template from {self.origin} failed to render: {e}") from e


def load_chat_template(directory: Path, tokenizer_config: Mapping[str, Any]) -> ChatTemplate | None:
    """The checkpoint's default chat template, or None if it has none.

    `chat_template.jinja` (what transformers 5 writes) takes priority over tokenizer_config.json's
    `chat_template`, which may be a string or a list of {"name", "template"} (we take "default").
    """
    special_tokens = read_special_tokens(tokenizer_config)
    template_path = directory / CHAT_TEMPLATE_FILE
    if template_path.is_file():
        source = template_path.read_text(encoding="utf-8")
        return ChatTemplate(source, str(template_path), special_tokens)
    entry = tokenizer_config.get("chat_template")
    if entry is None:
        return None
    origin = f"{directory / TOKENIZER_CONFIG_FILE} 'chat_template'"
    return ChatTemplate(_pick_default(entry, origin), origin, special_tokens)


def read_special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """Named special tokens as strings; a token may be saved as a string or an AddedToken dict."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = special_token_text(tokenizer_config.get(name), f"{TOKENIZER_CONFIG_FILE} '{name}'")
        if token is not None:
            tokens[name] = token
    return tokens


def special_token_text(value: Any, where: str) -> str | None:
    """The text of a special token saved as a string, an AddedToken dict or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(f"{where}: expected a string or a dict with 'content', got {value!r}")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages the way `transformers` prepares them for a template.

    Keys whose value is None are dropped (templates handle a missing key, not a literal None), and
    reasoning given under any of its names is visible under `reasoning_content` and `thinking`.
    """
    if len(messages) == 0:
        raise ValueError("cannot apply a chat template to an empty conversation")
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError(f"chat messages must be dicts, got {message!r}")
        plain = {key: _plain_copy(value) for key, value in message.items() if value is not None}
        normalized.append(_alias_reasoning(plain))
    return normalized


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain_copy(value: Any) -> Any:
    # A deep copy of lists and dicts, so a template's `.append` on a list never reaches the caller.
    if isinstance(value, Mapping):
        return {key: _plain_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_copy(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_copy(item) for item in value)
    return value


def _pick_default(entry: Any, origin: str) -> str:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        names = sorted(map(str, named))
        raise CheckpointError(f"{origin}: no template named 'default' among {names}")
    raise CheckpointError(f"{origin}: expected a string or a list of templates, got {type(entry)}")
