"""A bounded busy wait on a word of host memory, with the GIL released: the hybrid decode
step's hand-off between the calling thread and the CPU expert worker (moe/cpu_executor.py).

A blocked thread is woken through the kernel (a futex), and on a virtual machine whose idle
vCPUs halt that wake-up alone costs tens of µs, twice per layer and step. A thread that
instead polls the word for a few µs sees the other's store within a cache line transfer
(~0.1 µs). The wait is bounded in time (the monotonic clock, read every POLLS loads) so that
a late partner falls back to the blocking path; the caller decides when waiting is worth a
core.

`spin_until(address, value, max_ns)` returns True as soon as the int64 at `address` is >=
`value` (an acquire load: what the storing thread wrote before the word is visible after),
False after `max_ns` nanoseconds without. `store_then_spin` first stores a word for the other
side, with the GIL released: a thread polling for that word then never wakes to a GIL still
held by the storer (CPython's GIL has no polling: a thread that finds it held sleeps on a
condition variable, the very wake-up the polling avoids). Available where the C library has
clock_gettime (SPIN_SUPPORTED); elsewhere callers use their blocking path only.
"""

from __future__ import annotations

import sys
import time

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from hybridmoe import env
from hybridmoe.kernels import llvm_ir
from hybridmoe.kernels.numba_cache import cached_njit

POLLS = 64  # loads of the word between two clock reads (a clock read costs ~20 ns)
# CLOCK_MONOTONIC's id where the C library has clock_gettime (Linux, macOS, the BSDs)
_CLOCK_ID = getattr(time, "CLOCK_MONOTONIC", None)
SPIN_SUPPORTED = _CLOCK_ID is not None and sys.platform != "win32"

_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(env.kernel_cache_dir(__file__, llvm_ir.__file__))


@intrinsic
def _load_acquire(typingctx, address):
    """The int64 at `address`, an atomic load with acquire ordering (never hoisted out of a
    loop, as a plain load of unchanged memory may be)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        pointer = builder.inttoptr(args[0], llvm_ir.I64.as_pointer())
        return builder.load_atomic(pointer, "acquire", 8)

    return types.int64(address), codegen


@intrinsic
def _cpu_relax(typingctx):
    """x86's PAUSE (the core yields its pipeline to a sibling thread while polling); nothing
    on other targets."""

    def codegen(context, builder, signature, args):
        if llvm_ir.target_has("sse2"):
            builder.call(llvm_ir.declare(builder, "llvm.x86.sse2.pause", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _monotonic_ns(typingctx):
    """clock_gettime(CLOCK_MONOTONIC) in nanoseconds, the C library's (resolved by name when
    the code is loaded, so the compiled code caches)."""

    def codegen(context, builder, signature, args):
        timespec = ir.LiteralStructType([llvm_ir.I64, llvm_ir.I64])  # tv_sec, tv_nsec
        spec = builder.alloca(timespec)
        clock_gettime = llvm_ir.declare(
            builder, "clock_gettime", llvm_ir.I32, [llvm_ir.I32, timespec.as_pointer()]
        )
        builder.call(clock_gettime, [llvm_ir.i32(_CLOCK_ID), spec])
        seconds = builder.load(builder.gep(spec, [llvm_ir.i32(0), llvm_ir.i32(0)]))
        nanos = builder.load(builder.gep(spec, [llvm_ir.i32(0), llvm_ir.i32(1)]))
        return builder.add(builder.mul(seconds, llvm_ir.i64(1_000_000_000)), nanos)

    return types.int64(), codegen


@intrinsic
def _store_release(typingctx, address, value):
    """*address = value (int64), an atomic store with release ordering: what this thread wrote
    before is visible to a thread that loads the value."""
    if not isinstance(address, types.Integer) or not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        pointer = builder.inttoptr(args[0], llvm_ir.I64.as_pointer())
        stored = context.cast(builder, args[1], signature.args[1], types.int64)
        builder.store_atomic(stored, pointer, "release", 8)
        return context.get_dummy_value()

    return types.none(address, value), codegen


@cached_njit(nogil=True)
def spin_until(address: int, value: int, max_ns: int) -> bool:
    """True once the int64 at `address` is >= `value`, False after `max_ns` ns without."""
    end = _monotonic_ns() + max_ns
    while True:
        for _ in range(POLLS):
            if _load_acquire(address) >= value:
                return True
            _cpu_relax()
        if _monotonic_ns() >= end:
            return False


@cached_njit(nogil=True)
def store_then_spin(store_at: int, stored: int, address: int, value: int, max_ns: int) -> bool:
    """*store_at = stored, then spin_until(address, value, max_ns): the store made with the GIL
    already released, so the thread it wakes (polling for it) does not find the GIL held and
    sleep on it, a wake-up through the kernel again."""
    _store_release(store_at, stored)
    return spin_until(address, value, max_ns)


numba.config.CACHE_DIR = _previous_cache_dir
