"""Checks on the text of a parsed request body before anything else reads it."""

from __future__ import annotations

from typing import Any


def lone_surrogate_path(value: Any) -> str | None:
    """The dotted path ("messages.0.content") of a string in the parsed JSON `value` holding a
    lone surrogate (json.loads lets "\\ud800" through; UTF-8 cannot encode it), or of the
    object holding such a key ("" for the body itself); None when there is none. Iterative:
    any nesting json.loads accepts is walked without recursion."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _has_lone_surrogate(item):
                return path
            continue
        if not isinstance(item, dict | list):
            continue
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in reversed(list(children)):  # reversed: the first child pops first
            if isinstance(key, str) and _has_lone_surrogate(key):
                return path
            stack.append((f"{path}.{key}" if path else str(key), child))
    return None


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
