"""The registry of weight formats an expert matrix can be stored in.

Names are GGUF's type names in lower case. A format packs each row of n weights into
n // block_size blocks of block_bytes bytes, held in a tensor of `storage_dtype`; f32 and bf16
are the degenerate case of one weight a block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from hybridmoe.quant import q4_0, q8_0
from hybridmoe.quant._blocks import row_length_error


@dataclass(frozen=True)
class WeightFormat:
    """How a weight matrix [..., n] is stored. `quantize` turns a float tensor [..., n] into a
    contiguous tensor of `stored_shape` and `storage_dtype`, without modifying its input (for
    f32/bf16 it is a cast, and returns the input itself when already so stored); `dequantize`
    turns that back into float [..., n], exactly the values the stored tensor represents."""

    name: str
    block_size: int  # weights per block along a row
    block_bytes: int  # bytes per block
    storage_dtype: torch.dtype
    quantize_fn: Callable[[torch.Tensor], torch.Tensor] = field(repr=False)
    dequantize_fn: Callable[..., torch.Tensor] = field(repr=False)  # (q, dtype) -> float

    def __post_init__(self) -> None:
        if self.block_bytes % self.storage_dtype.itemsize:
            raise ValueError(f"{self.name}: {self.block_bytes} bytes is not whole elements")

    @property
    def is_quantized(self) -> bool:
        return self.block_size > 1

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of n weights."""
        self.check_row_length(n, f"{self.name} row")
        return n // self.block_size * self.block_bytes

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the stored tensor of a weight of `shape` [..., n]."""
        if not shape:
            raise ValueError(f"{self.name}: a weight needs at least one dimension")
        return (*shape[:-1], self.row_bytes(shape[-1]) // self.storage_dtype.itemsize)

    def check_row_length(self, n: int, what: str) -> None:
        if n % self.block_size:
            raise row_length_error(what, n, self.name, self.block_size)

    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        """Float w [..., n] -> the stored tensor, contiguous, of `stored_shape(w.shape)`."""
        if not w.is_floating_point():
            raise TypeError(f"{self.name}: quantize expects a float tensor, got {w.dtype}")
        return self.quantize_fn(w)

    def dequantize(self, q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The stored tensor q -> float dtype [..., n]."""
        if q.dtype != self.storage_dtype:
            raise TypeError(f"{self.name}: expects a {self.storage_dtype} tensor, got {q.dtype}")
        if not dtype.is_floating_point:
            raise TypeError(f"{self.name}: dequantize needs a float dtype, got {dtype}")
        return self.dequantize_fn(q, dtype)


def _cast(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return w.to(dtype).contiguous()


def _dense(name: str, dtype: torch.dtype) -> WeightFormat:
    cast = partial(_cast, dtype=dtype)
    return WeightFormat(name, 1, dtype.itemsize, dtype, cast, _cast)


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    fmt.name: fmt
    for fmt in (
        _dense("f32", torch.float32),
        _dense("bf16", torch.bfloat16),
        WeightFormat(
            "q8_0",
            q8_0.BLOCK_SIZE,
            q8_0.BLOCK_BYTES,
            torch.uint8,
            q8_0.quantize_q8_0,
            q8_0.dequantize_q8_0,
        ),
        WeightFormat(
            "q4_0",
            q4_0.BLOCK_SIZE,
            q4_0.BLOCK_BYTES,
            torch.uint8,
            q4_0.quantize_q4_0,
            q4_0.dequantize_q4_0,
        ),
    )
}


def weight_format(name: str) -> WeightFormat:
    """The registered format called `name`; ValueError listing the choices otherwise."""
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        choices = ", ".join(WEIGHT_FORMATS)
        raise ValueError(f"unknown weight format {name!r}; choose one of {choices}") from None


def dense_format(dtype: torch.dtype) -> WeightFormat:
    """The unquantised format of dtype: float32 -> f32, bfloat16 -> bf16; ValueError otherwise."""
    for fmt in WEIGHT_FORMATS.values():
        if not fmt.is_quantized and fmt.storage_dtype == dtype:
            return fmt
    raise ValueError(f"no dense weight format stores {dtype}; use float32 or bfloat16")
