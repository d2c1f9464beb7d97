"""Weights on transparent huge pages: a file mapping moved onto them in place (a GGUF's whole
mapping with `--huge-pages`; by default the ranges of the tensors every decode step reads
whole: move_ranges_to_huge_pages, loader/gguf.py), and the expert banks made at load advised
onto them (always: advise_huge_pages).

A decode step streams every expert and dense weight it uses; mapped from the file they sit on
4 KiB pages (Linux maps a regular file's page cache 4 KiB at a time unless the kernel has
CONFIG_READ_ONLY_THP_FOR_FS), one TLB entry per 4 KiB read: the step's weights evict every
other translation, and the Python between the kernels pays for that too. On 2 MiB pages the
same bytes need 512x fewer. Measured (AMD EPYC VM, 2 threads, the 4-layer Qwen3-30B-A3B-shaped
GGUFs of benchmarks/bench_vs_llamacpp.py; two engines in one process, one mapped and one on
huge pages, 8 alternating rounds of 100 greedy tokens, the median of the pairs' ratios): a
token in 0.897x the time for q4_k_m_all (every pair 0.83-0.92x), 0.965x for q4_0, 1.005x for
q4_k_m (whose bf16 attention dominates; pairs 0.85-1.04x).

A bank made at load (experts stacked from a Hugging Face checkpoint's per-expert tensors, or
quantised by --expert-format) is the process's own memory anyway: advised before it is written
it gets huge pages for nothing. Two engines in one process on the bench's safetensors
checkpoint, 8 alternating rounds of 100 tokens: q4_0 experts 0.885x the time a token, bf16
0.948x (medians of the pairs' ratios).

For a mapped GGUF the cost is the copy: the file's bytes become the process's own memory (its
RSS grows by the file; the page cache still holds the file until the kernel needs the room),
and the load reads the whole file once (the same runs: load 0.41 -> 3.13 s for the 1.45 GB
q4_k_m_all file; the copy itself 0.12 s into memory the VM had backed before). So it is
opt-in.

How: the mapping's bytes are copied into an anonymous private region advised MADV_HUGEPAGE
whose address has the mapping's offset within 2 MiB, then mremap(MREMAP_FIXED) moves that
region onto the mapping's addresses, replacing the file's pages. Every view made of the mapping
(numpy arrays, torch tensors) keeps its address and now reads the copy; unmapping the mapping
later unmaps the copy. Linux only; elsewhere, or where a call fails, the mapping stays as it
was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

HUGE_PAGE_BYTES = 2 << 20
COPY_CHUNK_BYTES = 64 << 20

# linux/mman.h, asm-generic/mman-common.h
_PROT_READ_WRITE = 0x1 | 0x2
_MAP_PRIVATE_ANONYMOUS = 0x02 | 0x20
_MADV_HUGEPAGE = 14
_MREMAP_MAYMOVE_FIXED = 0x1 | 0x2
_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc with the calls below typed (loaded once: a model's load moves a range per run of
    streamed tensors and advises every bank)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
    ]  # fmt: skip
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
    ]  # fmt: skip
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


@functools.cache
def huge_pages_supported() -> bool:
    """Whether this system can move a mapping (Linux with transparent huge pages not off)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask the kernel for huge pages under a new host tensor that is about to be written whole
    (an expert bank made at load): the whole 2 MiB pages inside its storage, advised before
    their first touch. A hint, free where the tensor is written anyway: nothing where the
    system has no transparent huge pages or the tensor spans no whole huge page."""
    if t.device.type != "cpu" or not huge_pages_supported():
        return
    storage = t.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last > first:
        _libc().madvise(first, last - first, _MADV_HUGEPAGE)


def move_to_huge_pages(mapped: np.ndarray, progress: Callable[[int], None] | None = None) -> bool:
    """Replace the pages of `mapped` (uint8, a mapping's whole length from its page-aligned
    start: a file mapped from offset 0) with an anonymous huge-page copy of its bytes, at the
    same addresses. `progress(bytes)` is called as the copy advances. False (nothing
    changed) where the system cannot."""
    if not huge_pages_supported() or mapped.nbytes == 0:
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    target = mapped.ctypes.data
    if target % page:
        return False
    size = -(-mapped.nbytes // page) * page
    libc = _libc()
    span = size + HUGE_PAGE_BYTES  # room to start the copy at the target's offset mod 2 MiB
    reserved = libc.mmap(None, span, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS, -1, 0)
    if reserved in (None, _MAP_FAILED):
        return False
    copy = aligned_like(reserved, target)
    try:
        libc.madvise(copy, size, _MADV_HUGEPAGE)  # a hint: a refusal leaves 4 KiB pages
        _copy_into(mapped, copy, progress)
        moved = libc.mremap(copy, size, size, _MREMAP_MAYMOVE_FIXED, target)
    except BaseException:
        libc.munmap(reserved, span)
        raise
    if moved != target:
        libc.munmap(reserved, span)
        return False
    # what is left of the reservation around the moved region
    libc.munmap(reserved, copy - reserved)
    libc.munmap(copy + size, reserved + span - (copy + size))
    return True


def move_ranges_to_huge_pages(
    mapped: np.ndarray,
    ranges: Sequence[Sequence[int]],
    progress: Callable[[int], None] | None = None,
) -> int:
    """move_to_huge_pages for the whole pages inside each byte range [start, end) of `mapped`
    (a whole-file mapping from a page-aligned start; a range ending at the file's end keeps
    its last, partial page): a page a range shares with bytes outside it stays mapped. The
    bytes moved (0 where the system cannot)."""
    page, moved = os.sysconf("SC_PAGE_SIZE"), 0
    for start, end in ranges:
        low = -(-start // page) * page
        high = mapped.nbytes if end >= mapped.nbytes else end // page * page
        if high > low and move_to_huge_pages(mapped[low:high], progress):
            moved += high - low
    return moved


def aligned_like(reserved: int, target: int) -> int:
    """The first address from `reserved` with `target`'s offset within a huge page: a region
    moved there onto `target` keeps its huge pages (mremap moves them whole only between
    addresses that agree mod 2 MiB)."""
    return reserved + (target - reserved) % HUGE_PAGE_BYTES


def _copy_into(mapped: np.ndarray, address: int, progress) -> None:
    """The bytes of `mapped` into memory at `address`, in chunks, read through the mapping
    (the page cache's pages) by torch's threads: both sides' page faults on every core (one
    thread's copy measured 2x slower)."""
    source, nbytes = torch.from_numpy(mapped), mapped.nbytes
    for start in range(0, nbytes, COPY_CHUNK_BYTES):
        n = min(COPY_CHUNK_BYTES, nbytes - start)
        dst = np.frombuffer((ctypes.c_char * n).from_address(address + start), np.uint8)
        torch.from_numpy(dst).copy_(source[start : start + n])
        if progress is not None:
            progress(n)
