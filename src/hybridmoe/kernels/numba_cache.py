"""numba's on-disk cache, treating a damaged entry as missing. numba itself raises whatever
unpickling a truncated or overwritten index/data file raises (EOFError, UnpicklingError, ...)
on every call of the kernel, in every later run: one bad file breaks the CPU targets for good.
Here such an entry is reported, its index removed, and the kernel compiled (and cached) anew."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Hashable

import numba
from numba.core.caching import FunctionCache
from numba.core.dispatcher import Dispatcher

log = logging.getLogger(__name__)


class RebuildingFunctionCache(FunctionCache):
    """A FunctionCache whose unreadable entries count as misses (then are overwritten)."""

    def load_overload(self, sig, target_context):
        try:
            return super().load_overload(sig, target_context)
        except Exception as exc:  # any damage to the files, whatever unpickling it raises
            index = self._cache_file._index_path
            log.warning(
                "the compiled-kernel cache entry %s is unreadable (%s: %s); recompiling",
                index,
                type(exc).__name__,
                exc,
            )
            _remove(index)  # the next save writes a fresh index (and overwrites data files)
            return None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def rebuild_damaged(dispatcher: Dispatcher) -> Dispatcher:
    """`dispatcher` (an njit(cache=True) function) with a RebuildingFunctionCache. Call it
    while numba.config.CACHE_DIR names the directory the dispatcher was decorated under."""
    dispatcher._cache = RebuildingFunctionCache(dispatcher.py_func)
    return dispatcher


def cached_njit(**options):
    """numba.njit(cache=True, **options) whose damaged cache entries are rebuilt."""

    def decorate(fn):
        return rebuild_damaged(numba.njit(cache=True, **options)(fn))

    return decorate


class EntryCache:
    """Kernel entry points made on first use (one per format or pair of formats: numba compiles
    only what a model uses), each decorated while numba.config.CACHE_DIR is `cache_dir` (numba
    picks a function's cache directory when it is decorated), under one lock."""

    def __init__(self, cache_dir: str):
        self._cache_dir, self._lock = cache_dir, threading.Lock()
        self._entries: dict[Hashable, Dispatcher] = {}

    def values(self) -> list[Dispatcher]:
        """The entries made so far (a dict's values, as benchmarks/bench_decode_overhead.py
        reads them to tell the kernels' launches apart)."""
        with self._lock:
            return list(self._entries.values())

    def get(self, key: Hashable, make: Callable[[], Dispatcher]) -> Dispatcher:
        """The entry of `key`, make() on its first request."""
        with self._lock:
            if key not in self._entries:
                previous, numba.config.CACHE_DIR = numba.config.CACHE_DIR, self._cache_dir
                try:
                    self._entries[key] = make()
                finally:
                    numba.config.CACHE_DIR = previous
            return self._entries[key]
