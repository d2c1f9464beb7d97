"""Every environment variable hybridmoe reads (or sets), handled here and nowhere else."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """HYBRIDMOE_CACHE_DIR, else $XDG_CACHE_HOME/hybridmoe, else ~/.cache/hybridmoe."""
    explicit = os.environ.get("HYBRIDMOE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hybridmoe"


def kernel_cache_dir(*sources: str | Path) -> Path:
    """Where compiled CPU kernels are cached: under $NUMBA_CACHE_DIR if set, else cache_dir(),
    in a directory named by a hash of the kernels' source files (a changed source never
    meets code compiled from the old one)."""
    digest = hashlib.sha256(b"".join(Path(s).read_bytes() for s in sources)).hexdigest()[:16]
    root = os.environ.get("NUMBA_CACHE_DIR")
    return (Path(root) if root else cache_dir() / "numba") / digest


def hybrid_overlap() -> bool:
    """HYBRIDMOE_HYBRID_OVERLAP=0 serialises the hybrid CPU wait before the accelerator work
    (a measurement switch; the config field `overlap` is the normal way)."""
    return os.environ.get("HYBRIDMOE_HYBRID_OVERLAP", "1") != "0"


@functools.cache
def dense_kernel() -> bool:
    """HYBRIDMOE_DENSE_KERNEL=0 computes every dense projection with torch, the CPU decode
    steps' too (a measurement switch: the numba kernel's before/after). Read once, as
    glue_kernels (reread_switches)."""
    return os.environ.get("HYBRIDMOE_DENSE_KERNEL", "1") != "0"


def cpu_inline() -> bool:
    """Whether the cpu device computes its CPU expert jobs on the calling thread instead of
    the executor's worker thread (there is nothing to overlap there): yes unless
    HYBRIDMOE_CPU_INLINE=0 (a measurement switch). On the worker path the worker's OpenMP team
    and the calling thread's (dense kernels) are two teams that sleep and wake each other on
    every layer; inline, one team does both and its pool threads stay hot between kernels
    (libgomp's spin). Quiet, 1 GB q8_0 GGUF, 2 threads: 66.8 vs 30.9 tok/s decode, prefill
    466 vs 217 (benchmarks/bench_vs_llamacpp.py; docs/architecture.md)."""
    return os.environ.get("HYBRIDMOE_CPU_INLINE", "1") != "0"


def spin_us() -> float | None:
    """HYBRIDMOE_SPIN_US: how long (µs) the hybrid hand-off between the calling thread and
    the CPU expert worker polls before it blocks (moe/cpu_executor.py); 0 never polls (a
    measurement switch). None when unset: the executor's default."""
    value = os.environ.get("HYBRIDMOE_SPIN_US")
    if value is None:
        return None
    try:
        spin = float(value)
    except ValueError:
        spin = -1.0
    if not spin >= 0:
        raise ValueError(f"HYBRIDMOE_SPIN_US must be a number of µs >= 0, got {value!r}")
    return spin


def serial_torch() -> bool:
    """HYBRIDMOE_SERIAL_TORCH=0 keeps torch's intra-op threads during a CPU decode step
    (a measurement switch: kernels/threads.serial_torch_ops' before/after)."""
    return os.environ.get("HYBRIDMOE_SERIAL_TORCH", "1") != "0"


@contextmanager
def passive_openmp() -> Iterator[None]:
    """Within the block OMP_WAIT_POLICY is PASSIVE unless the user set it, for a program to
    import torch inside (nothing in hybridmoe does: the cpu device's inline executor wants
    libgomp's spin, docs/architecture.md); HYBRIDMOE_PASSIVE_OPENMP=0 leaves libgomp's
    default, a ~3 ms spin (a measurement switch)."""
    if os.environ.get("HYBRIDMOE_PASSIVE_OPENMP", "1") == "0":
        yield
        return
    with default_set("OMP_WAIT_POLICY", "PASSIVE"):
        yield


def auto_device() -> str | None:
    """HYBRIDMOE_AUTO_DEVICE: what `--device auto` means instead of "the accelerator if any"
    (the CPU test suite sets it to cpu, so it tests the cpu tier on a GPU machine too)."""
    return os.environ.get("HYBRIDMOE_AUTO_DEVICE") or None


@contextmanager
def default_set(name: str, value: str) -> Iterator[None]:
    """Within the block, `name` is `value` unless the user set it; restored afterwards. For
    runtimes that read a variable once when they load (libgomp's OMP_WAIT_POLICY)."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


@functools.cache
def attention_block() -> bool:
    """HYBRIDMOE_ATTENTION_BLOCK=0 runs a CPU decode step's attention part by part (the q/k/v
    projection, norms and rotary, attention, o projection: one kernel call each) and its final
    norm and output head too (kernels/head_block.py), instead of one call each (kernels/
    attention_block.py; a measurement switch: the same bits). Read once, as glue_kernels."""
    return os.environ.get("HYBRIDMOE_ATTENTION_BLOCK", "1") != "0"


@functools.cache
def glue_kernels() -> bool:
    """HYBRIDMOE_GLUE_KERNELS=0 computes the decode step's norms, residual adds, router top-k,
    MoE output rounding and KV writes with torch on the CPU too (a measurement switch: the
    numba glue kernels' before/after, kernels/numba_glue.py). Read once (it is asked ~30 times a
    decoded token, each read ~1-3 µs on a decode step's cold caches): reread_switches() makes
    the next call read it again."""
    return os.environ.get("HYBRIDMOE_GLUE_KERNELS", "1") != "0"


def reread_switches() -> None:
    """The switches read once (dense_kernel, attention_block, glue_kernels) read the
    environment again on their next call: for a process that sets them after their first
    read (the tests)."""
    for switch in (dense_kernel, attention_block, glue_kernels):
        switch.cache_clear()
