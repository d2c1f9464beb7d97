"""A first run's fused expert kernels compiled side by side, in helper processes.

numba compiles a model's fused expert kernel once per kind of bank (formats, layout, ...) on
the kernel's first call, one kind after another on one core, and keeps the result in its disk
cache (kernels/numba_moe.py): a Q4_K_M GGUF mixes two kinds (Q4_K gate/up with Q4_K or Q6_K
down), ~20 s each on an idle core of the Intel Xeon (2026-12-07). On a machine with an empty
cache CpuMoeExecutor compiles one kind itself while each other kind not in the cache compiles
in a helper process of its own (`python -m hybridmoe.moe.compile_helpers`, given the entry
point's formats and the argument types to compile for), up to one helper a core beyond the
first; the calls that follow load the helpers' work from the cache. The cache's saves are
locked across processes (kernels/numba_cache.py). A helper that fails, or whose cache
directory is not the caller's, only costs its time: the caller's own call compiles the kind
as before. With everything in the cache no helper starts (the index is read, nothing else).
HYBRIDMOE_COMPILE_HELPERS=N caps the helpers (0: none)."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hybridmoe.kernels import compile_progress
from hybridmoe.kernels.numba_cache import index_lock
from hybridmoe.quant.bank import ExpertBank

log = logging.getLogger(__name__)

HELPERS_ENV = "HYBRIDMOE_COMPILE_HELPERS"


@dataclass
class Helpers:
    """The helper processes started for some of the banks' kernels."""

    banks: list[ExpertBank] = field(default_factory=list)  # whose kernels the helpers compile
    processes: list[subprocess.Popen] = field(default_factory=list)

    def wait(self) -> None:
        """Wait for every helper (the compile counter, when one is shown, says so and keeps
        its clock running); a failed helper is logged, its kind then compiles in the caller."""
        counter = compile_progress.active()
        bar = counter.bar if counter is not None else None
        for process in self.processes:
            while process.poll() is None:
                if bar is not None:
                    running = sum(p.poll() is None for p in self.processes)
                    bar.set_postfix_str(f"{running} kernel(s) in helper processes", refresh=True)
                time.sleep(0.25)
            if process.returncode != 0:
                log.info("a kernel compile helper exited with %s", process.returncode)

    def stop(self) -> None:
        """End every helper now (the caller is failing or interrupted)."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            process.wait()


def helper_limit() -> int:
    """How many helpers may run: HYBRIDMOE_COMPILE_HELPERS, else one per core beyond the
    caller's."""
    value = os.environ.get(HELPERS_ENV) or None  # empty: unset
    if value is not None:
        if not value.isdigit():
            raise ValueError(f"{HELPERS_ENV} must be a whole number >= 0, got {value!r}")
        return int(value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, (cores or 1) - 1)


def start_missing(banks: Sequence[ExpertBank]) -> Helpers:
    """Helpers for the kernels of `banks` (one per kind) that miss the disk cache, all but the
    first (the caller's own), at most helper_limit()."""
    from hybridmoe.moe.cpu_experts import kernel_entry, kernel_signature

    limit = helper_limit()
    if limit == 0 or len(banks) < 2:
        return Helpers()
    missing, seen = [], set()
    for bank in banks:
        formats, sig = kernel_signature(bank)
        if (formats, sig) in seen:
            continue
        seen.add((formats, sig))
        dispatcher = kernel_entry(formats)
        if not is_cached(dispatcher, sig):
            missing.append((bank, formats, sig, dispatcher._cache._cache_path))
    helpers = Helpers()
    for bank, formats, sig, cache_path in missing[1 : 1 + limit]:
        helpers.banks.append(bank)
        helpers.processes.append(_start(formats, sig, cache_path))
    return helpers


def is_cached(dispatcher, sig: tuple) -> bool:
    """Whether numba's disk cache holds `dispatcher` compiled for `sig` (its index names it;
    the data is not read). True when that cannot be told (numba's cache internals changed):
    the caller then compiles as without helpers."""
    try:
        cache = dispatcher._cache
        key = cache._index_key(sig, dispatcher.targetctx.codegen())
        with index_lock(cache._cache_file._index_path, exclusive=False):
            return key in cache._cache_file._load_index()
    except Exception as exc:  # numba internals: any change means "unknown"
        log.debug("cannot read the kernel cache's index: %s", exc)
        return True


def _start(formats: tuple, sig: tuple, cache_path: str) -> subprocess.Popen:
    """`python -m hybridmoe.moe.compile_helpers`, handed (formats, sig, cache path) on stdin,
    importing this same package."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_root, env.get("PYTHONPATH"))))
    process = subprocess.Popen(
        [sys.executable, "-m", "hybridmoe.moe.compile_helpers"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    process.stdin.write(pickle.dumps((formats, sig, cache_path)))
    process.stdin.close()
    return process


def main() -> int:
    """A helper: compile the entry point of the formats on stdin for its argument types, into
    the disk cache; exit 3 when this process's cache directory is not the caller's."""
    formats, sig, cache_path = pickle.load(sys.stdin.buffer)
    from hybridmoe.moe.cpu_experts import kernel_entry

    dispatcher = kernel_entry(formats)
    if dispatcher._cache._cache_path != cache_path:
        return 3
    dispatcher.compile(sig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
