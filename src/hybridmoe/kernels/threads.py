"""The thread policy of a CPU decode step: torch's ops serial, the numba kernels on every
thread the user gave (torch's intra-op count outside the step)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_SAVED = threading.local()  # .threads: torch's intra-op count outside serial_torch_ops


@contextmanager
def serial_torch_ops() -> Iterator[None]:
    """Within the block torch's ops run on one thread while the numba kernels keep the thread
    count torch had (kernel_threads()). For a CPU decode step: its torch ops are too small to
    split, yet each of torch's OpenMP parallel regions leaves its pool threads spinning (torch's
    libgomp waits ACTIVE for ~ms by default), on the cores the numba kernels need. Results do
    not depend on it (torch's and the kernels' reductions do not depend on the thread count).
    Not reentrant across threads: torch's count is process-wide; nesting is fine."""
    if getattr(_SAVED, "threads", None) is not None:
        yield
        return
    saved = torch.get_num_threads()
    _SAVED.threads = saved
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
        _SAVED.threads = None


def kernel_threads() -> int:
    """The thread count a numba kernel uses by default: torch's intra-op count (the user's
    --threads), as it was outside serial_torch_ops."""
    saved = getattr(_SAVED, "threads", None)
    return torch.get_num_threads() if saved is None else saved
