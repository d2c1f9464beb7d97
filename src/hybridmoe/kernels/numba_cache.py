"""numba's on-disk cache, treating a damaged entry as missing and kept consistent between
processes.

numba itself raises whatever unpickling a truncated or overwritten index/data file raises
(EOFError, UnpicklingError, ...) on every call of the kernel, in every later run: one bad file
breaks the CPU targets for good. Here such an entry is reported, its index removed, and the
kernel compiled (and cached) anew.

numba keeps one index file a function (signature -> data file) and saves an overload by
reading the index, naming a data file, writing the index, then the data, with no lock. Two
processes saving different signatures of one function at once (pytest-xdist workers, the test
suite's kernel warm-up shards, a cluster's replicas on a first run) can both name the same
data file, leaving an index that maps one signature to the other's code, which a later run
loads and calls without complaint (a float64 overload answered f(2.5) = 3 in a reproduction);
a load between a save's index and data writes can read a stale data file the same way. Here
a save holds an exclusive lock on the index (flock on a `.lock` file beside it) and a load a
shared one."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import numba
from numba.core.caching import FunctionCache
from numba.core.dispatcher import Dispatcher

try:
    import fcntl
except ImportError:  # no flock (Windows): numba's own unlocked index
    fcntl = None

log = logging.getLogger(__name__)


class RebuildingFunctionCache(FunctionCache):
    """A FunctionCache whose unreadable entries count as misses (then are overwritten), and
    whose saves and loads of one function's entries exclude each other across processes."""

    def load_overload(self, sig, target_context):
        index = self._cache_file._index_path
        try:
            with index_lock(index, exclusive=False):
                return super().load_overload(sig, target_context)
        except Exception as exc:  # any damage to the files, whatever unpickling it raises
            log.warning(
                "the compiled-kernel cache entry %s is unreadable (%s: %s); recompiling",
                index,
                type(exc).__name__,
                exc,
            )
            with index_lock(index, exclusive=True):
                _remove(index)  # the next save writes a fresh index (and overwrites data files)
            return None

    def save_overload(self, sig, data):
        with index_lock(self._cache_file._index_path, exclusive=True):
            super().save_overload(sig, data)


@contextmanager
def index_lock(index_path: str, exclusive: bool) -> Iterator[None]:
    """Within the block this process (this open of the lock file: threads exclude each other
    too) holds an flock on `index_path`.lock, exclusive or shared. Where the lock file cannot
    be made (a read-only cache directory: nothing is saved there either) or flock does not
    exist, the block runs unlocked, as numba's own cache does."""
    fd = None
    if fcntl is not None:
        try:
            os.makedirs(os.path.dirname(index_path), exist_ok=True)
            fd = os.open(index_path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


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
