"""WeightSource: named tensors of a checkpoint, memory-mapped from its safetensors files.

Tensors whose dtype already matches are returned as views into the file mapping, so the
model's weights are not copied into anonymous memory; the page cache holds them once. The
exception is a tensor whose data is not 64-byte aligned in its file: it is copied once into
aligned memory (see `aligned`), so every tensor handed out is 64-byte aligned.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from hybridmoe.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"

# Stored dtypes a weight may have: plain floats, whose values the cast to the model's dtype keeps
# (up to that dtype's rounding). A float8 or integer weight is a quantised one: without its
# format's scales its values are not the model's, so it is refused, never cast.
READABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def find_safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files: those named by the index when there is one."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [directory / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # ValueError: not JSON or not UTF-8; the others: no {tensor name: file name} map
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} names weight files that are missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weight files found")
    return files


@dataclass(frozen=True)
class MergedExperts:
    """One MoE layer's routed experts as a file stores them merged (GGUF's
    `blk.N.ffn_{gate,up,down}_exps`): three tensors, each in the file's type for it in
    `type_names` (ggml type names such as "Q8_0"; a Q4_K_M file stores Q4_K gate and up beside
    Q6_K down), each [E, rows, row storage] (uint8 blocks, or the floats), views of the
    file's mapping."""

    gate: torch.Tensor  # stored [E, I, row(H)]
    up: torch.Tensor  # stored [E, I, row(H)]
    down: torch.Tensor  # stored [E, H, row(I)]
    type_names: tuple[str, str, str]  # gate's, up's, down's
    names: tuple[str, str, str]  # the three tensors' names in the file, for errors
    path: Path


class WeightSource:
    """Read-only access to a checkpoint's tensors by name, with shape checks and dtype casts."""

    def __init__(self, files: Sequence[Path], dtype: torch.dtype, progress: bool = False):
        self.dtype = dtype
        self._handles = {}
        self._file_of: dict[str, Path] = {}
        self._read: set[str] = set()  # names `get` has handed out
        for path in files:
            handle = self._open(path)
            self._handles[path] = handle
            for name in handle.keys():
                self._file_of[name] = path
        self._bar = tqdm(
            total=len(self._file_of), desc="loading weights", unit="tensor", disable=not progress
        )

    @classmethod
    def from_dir(cls, directory: Path, dtype: torch.dtype, progress: bool = False) -> WeightSource:
        return cls(find_safetensors_files(directory), dtype, progress)

    @staticmethod
    def _open(path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read safetensors file ({exc})") from exc

    def has(self, name: str) -> bool:
        return name in self._file_of

    def _read_tensor(self, name: str) -> tuple[Path, torch.Tensor]:
        """(its file, tensor `name` as stored), marked read; CheckpointError if missing or
        unreadable."""
        path = self._file_of.get(name)
        if path is None:
            raise CheckpointError(f"tensor '{name}' is missing from the checkpoint")
        self._read.add(name)
        try:
            return path, self._handles[path].get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' ({exc})") from exc

    def get_stored(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` exactly as stored (the file's view, no cast), which must be `dtype`:
        the bytes of a quantised format (e.g. MXFP4 blocks and exponents, uint8). CheckpointError
        if it is missing, mis-shaped or stored as another dtype."""
        path, tensor = self._read_tensor(name)
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor '{name}' is {_dtype_name(tensor.dtype)} {tuple(tensor.shape)}, "
                f"config.json implies {_dtype_name(dtype)} {tuple(shape)}"
            )
        self._bar.update()
        return tensor

    def get(self, name: str, shape: Sequence[int], align: bool = True) -> torch.Tensor:
        """Tensor `name` in the source dtype; CheckpointError if it is missing or mis-shaped.
        With `align=False` a tensor in the source dtype stays the file's view wherever it lies
        (for weights the caller copies anyway, or aligns itself: see `aligned`)."""
        path, tensor = self._read_tensor(name)
        if tensor.dtype not in READABLE_DTYPES:
            raise CheckpointError(
                f"{path}: tensor '{name}' is stored as {_dtype_name(tensor.dtype)}, which cannot "
                f"be read as {_dtype_name(self.dtype)} without its quantisation scales; only "
                f"{', '.join(_dtype_name(d) for d in READABLE_DTYPES)} weights are supported"
            )
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor '{name}' has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(shape)}"
            )
        self._bar.update()
        tensor = tensor if tensor.dtype == self.dtype else tensor.to(self.dtype)
        return aligned(tensor) if align else tensor

    def merged_experts(self, prefix: str, names: tuple[str, str, str]) -> MergedExperts | None:
        """None: a safetensors checkpoint stores each expert's matrices apart (`get` them)."""
        return None

    def unread_names(self) -> list[str]:
        """Names in the checkpoint that `get` has not been asked for, sorted."""
        return sorted(self._file_of.keys() - self._read)

    def close(self) -> None:
        self._bar.close()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


ALIGNMENT_BYTES = 64  # an AVX-512 vector and a cache line: the widest any CPU kernel peels to


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` if its data starts at a multiple of ALIGNMENT_BYTES, else an aligned copy (the
    mapped pages behind the original are released; torch's CPU allocator aligns to 64 bytes).

    Why: a CPU GEMV kernel may peel an unaligned head off each row, so its summation order,
    hence the last bits of the result, depend on the weight's address mod the vector width
    (MKL's sgemv on its SSE4.2 path does; MKL picks its paths by CPU vendor and model, so this
    differs between x86-64 machines). safetensors writers align tensors to 8 bytes only, so
    without this the same weights in one file or in shards could give different logits."""
    if tensor.data_ptr() % ALIGNMENT_BYTES == 0:
        return tensor
    copy = tensor.clone(memory_format=torch.contiguous_format)
    release_pages([tensor])
    return copy


_MADV_DONTNEED = 4  # linux/mman.h


def release_pages(tensors: list[torch.Tensor]) -> None:
    """Drop the resident pages behind memory-mapped `tensors` that the caller no longer uses.

    After a layer's experts are copied into a host bank, their file-backed pages would stay in
    this process's RSS; the mapping is private and the pages clean, so discarding them is safe
    (a later read would fault them back in from the file). Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    for tensor in tensors:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        first, last = -(-start // page) * page, end // page * page  # whole pages inside only
        if last > first:
            libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
