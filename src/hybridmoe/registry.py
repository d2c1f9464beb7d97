"""The one mechanism behind the project's registries (routers, attention kinds, CPU kernels,
weight formats, decode targets): a dict by name that refuses a second entry of a name."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def add_entry(table: dict[str, T], what: str, name: str, entry: T) -> T:
    """table[name] = entry and return it; ValueError if `name` is taken (`what` names the kind
    of entry in the message: "router kind", "weight format", ...)."""
    if name in table:
        raise ValueError(f"{what} {name!r} is already registered")
    table[name] = entry
    return entry


def registering(table: dict[str, T], what: str, name: str) -> Callable[[T], T]:
    """Decorator form of add_entry."""
    return lambda entry: add_entry(table, what, name, entry)
