"""A dispatch mode that records every aten op run under it: tests that count a call's torch ops."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class CountingOps(TorchDispatchMode):
    """`with CountingOps() as counter: ...`; then counter.ops lists the aten ops, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
