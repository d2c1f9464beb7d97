"""A counter of numba's compilations on stderr while a block runs, so that the first run on a
machine does not sit silent: the CPU kernels are compiled for the host's instructions when
first called (about half a minute for the demo model on 2 cores) and loaded from numba's
on-disk cache afterwards (kernels/numba_moe.py), where nothing is compiled and nothing is
shown. numba announces each compilation that missed its cache as a "numba:compile" event
(numba.core.event), on whichever thread compiles; a load from the cache is no such event."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from numba.core import event
from tqdm import tqdm

DESCRIPTION = "compiling CPU kernels for this machine (once: kept in the disk cache)"


class _CompileCounter(event.Listener):
    """A tqdm counter of compiled functions, opened at the first compilation; its postfix
    names the outermost function being compiled (the others are the functions it calls)."""

    def __init__(self, file: TextIO | None):
        self.file = file
        self.bar: tqdm | None = None
        self.depth = 0
        self.compiled = 0

    def on_start(self, ev: event.Event) -> None:
        if self.bar is None:
            self.bar = tqdm(desc=DESCRIPTION, unit=" functions", file=self.file or sys.stderr)
        if self.depth == 0:
            self.bar.set_postfix_str(_name(ev), refresh=True)
        self.depth += 1

    def on_end(self, ev: event.Event) -> None:
        self.depth -= 1
        self.compiled += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str("done", refresh=False)
            self.bar.close()


def _name(ev: event.Event) -> str:
    dispatcher = (ev.data or {}).get("dispatcher")
    return getattr(getattr(dispatcher, "py_func", None), "__name__", "")


_ACTIVE: list[_CompileCounter] = []  # the counter of the outermost block open, if any


def active() -> _CompileCounter | None:
    """The counter of the block open (its `.bar` None until something compiled), if any."""
    return _ACTIVE[0] if _ACTIVE else None


@contextmanager
def compile_progress(enabled: bool = True, file: TextIO | None = None) -> Iterator[_CompileCounter]:
    """Within the block, every numba compilation counts on a progress counter (on `file`,
    default stderr), shown from the first one; nothing is shown when nothing compiles or when
    not `enabled`. Yields the counter (`.compiled`: functions compiled so far). A block opened
    inside another (the CLI's around the engine's) counts on the outer block's counter: one
    counter on the screen."""
    if _ACTIVE or not enabled:
        yield _ACTIVE[0] if _ACTIVE else _CompileCounter(file)
        return
    counter = _CompileCounter(file)
    _ACTIVE.append(counter)
    try:
        with event.install_listener("numba:compile", counter):
            yield counter
    finally:
        _ACTIVE.clear()
        counter.close()
