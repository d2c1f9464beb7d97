"""Safetensors files written byte by byte with a chosen layout: the tensors in a given order and
the data buffer starting at a chosen offset mod 64, so tests can put the same tensor at
different alignments (the `safetensors` writer decides the layout itself)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], data_start_mod_64: int = 0
) -> None:
    """`tensors` stored in their dict order, the header padded with spaces (as the format
    allows) so that the data buffer starts at a file offset ≡ `data_start_mod_64` (mod 64)."""
    entries, offset = {}, 0
    for name, tensor in tensors.items():
        end = offset + tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    header = json.dumps(entries).encode()
    header += b" " * ((data_start_mod_64 - 8 - len(header)) % 64)
    with open(path, "wb") as file:
        file.write(len(header).to_bytes(8, "little") + header)
        for tensor in tensors.values():
            file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def tensor_offsets_mod_64(path: Path) -> dict[str, int]:
    """Where each tensor's data starts in the file, mod 64 (= its address mod 64 when mapped)."""
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    header.pop("__metadata__", None)
    return {
        name: (8 + header_len + entry["data_offsets"][0]) % 64 for name, entry in header.items()
    }
