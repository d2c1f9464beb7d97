"""Numpy views of host tensors by address, for the numba kernels' arguments: a decode step
hands each kernel its inputs and outputs once per layer, and under torch.inference_mode (the
model's forward) `Tensor.numpy()` dispatches 4 aten ops (detach, to, resolve_conj,
resolve_neg), a bf16 tensor's view as uint16 one more; this dispatches none. And back: a
kernel's numpy output as a torch view (host_logits)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch


def host_array(t: torch.Tensor, dtype: type[np.generic]) -> np.ndarray:
    """Contiguous host tensor `t`'s memory as a flat writable numpy array of `dtype` (of t's
    element size: np.uint16 for bfloat16 bits), valid while `t` lives and keeps its storage.
    ValueError for a tensor on another device or not contiguous."""
    if not (t.is_cpu and t.is_contiguous()):
        raise ValueError(
            f"a kernel argument must be contiguous host memory, got a {tuple(t.shape)} tensor "
            f"on {t.device} with strides {t.stride()}"
        )
    nbytes = t.numel() * t.element_size()
    return np.frombuffer((ctypes.c_char * nbytes).from_address(t.data_ptr()), dtype)


def host_logits(values: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """A kernel's output [rows * cols] (float32, or uint16 bfloat16 bits) as a torch tensor
    [rows, cols] of its values, a view (a router's logits left for torch to route)."""
    out = torch.from_numpy(values)
    return (out.view(torch.bfloat16) if values.dtype == np.uint16 else out).view(rows, cols)
