"""The registry of weight formats an expert matrix can be stored in.

Names are GGUF's type names in lower case. A format packs each row of n weights into
n // block_size blocks of block_bytes bytes, held in a tensor of `storage_dtype`; f32, bf16
and f16 are the degenerate case of one weight a block, the k-quants (q2_k ... q6_k) pack
super-blocks of 256 weights. Each format is one module (dense.py: f32, bf16 and f16; q8_0.py;
q4_0.py; ...; q6_k.py, the k-quants sharing _kquants.py; mxfp4.py) that defines its `WeightFormat`,
torch reference and kernel IR, and registers it with `register_format`. The package
(quant/__init__.py) imports those modules, in the order CLI choices list them, so the
registry is complete once anything of `hybridmoe.quant` is imported, this module included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridmoe.quant._blocks import row_length_error
from hybridmoe.registry import add_entry

KERNEL_BLOCK = 32  # weights of a row the CPU kernels dequantise at once: one <32 x float>

# LLVM IR builders (llvmlite objects; see kernels/llvm_ir.py):
# (builder, byte pointer to a block) -> <32 x float>, the KERNEL_BLOCK weights of that block
DequantizeBlockIR = Callable[[Any, Any], Any]
# A super-block's: (builder, byte pointer to a super-block) -> piece, where piece(p), p a
# Python int < pieces, emits the super-block's weights 32p .. 32p + 31 as <32 x float>. What
# the pieces share (the decoded sub-block scales) is emitted once, before `piece` is returned.
DequantizeSuperBlockIR = Callable[[Any, Any], Callable[[int], Any]]
# (builder, byte pointer to one weight) -> float
LoadWeightIR = Callable[[Any, Any], Any]
# (builder, byte pointer to a block) -> (<32 x i8> signed integers v, byte pointer to the
# block's fp16 scale s): the block's weights are exactly s * v, |v| <= 127 (the integer-dot
# kernels, quant/activation_q8.py, which convert 8 blocks' scales at once)
Int8BlockIR = Callable[[Any, Any], tuple[Any, Any]]
# (builder, byte pointer to a block) -> (byte pointer to the block's 16 bytes of 4-bit weights,
# byte pointer to its fp16 scale s): weight j is s * (u_j - NIBBLE_ZERO), u_j the low nibble of
# byte j for j < 16, the high nibble of byte j - 16 after (GGUF's q4_0); the q8 tile then
# unpacks two rows' blocks in one vector and converts 8 blocks' scales at once
# (kernels/numba_simd_q8.py)
NibbleBlockIR = Callable[[Any, Any], tuple[Any, Any]]
NIBBLE_ZERO = 8
# (builder, byte pointer to a super-block) -> quant/_kquants.SuperBlockIntsIR: a k-quant
# super-block as integers for the integer-dot kernels (the q8 contract, quant/activation_q8.py)
SuperBlockIntsIR = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class KernelFormat:
    """What the fused CPU kernel (kernels/numba_moe.py) compiles for a format: it reads a row
    as `block_bytes` bytes per `block_weights` weights and emits `dequantize_block_ir` for each
    block. A block is one KERNEL_BLOCK of 32 weights (pieces = 1: the IR builder is a
    DequantizeBlockIR) or a super-block of `pieces` of them (the k-quants: 8 pieces of 32, a
    DequantizeSuperBlockIR, so that the super-block's scales are decoded once for all its
    pieces). A format whose rows may end in part of a block (dense ones, of any length) also
    gives `load_weight_ir`, which reads the tail weight by weight. The IR builders run when
    numba compiles (they import kernels/llvm_ir.py, and so llvmlite, then); the source of the
    module that defines them, with llvm_ir.py's, is part of the hash naming the kernels'
    on-disk cache, so they belong in the format's own module, with helpers from llvm_ir.py."""

    name: str
    block_bytes: int  # bytes of block_weights consecutive weights of a row
    dequantize_block_ir: DequantizeBlockIR | DequantizeSuperBlockIR = field(repr=False)
    load_weight_ir: LoadWeightIR | None = field(default=None, repr=False)
    pieces: int = 1  # KERNEL_BLOCKs a block holds: 1, or 8 for a 256-weight super-block
    # a 32-weight block as integers and one scale, for formats whose blocks are that (q8_0,
    # q4_0): with activation_quant q8 their projections take integer dot products
    int8_block_ir: Int8BlockIR | None = field(default=None, repr=False)
    # the same blocks as 4-bit weights (q4_0): the q8 tile's faster unpacking of them
    nibble_block_ir: NibbleBlockIR | None = field(default=None, repr=False)
    # a super-block as integers (the k-quants q2_k ... q6_k): their integer dot products under q8
    superblock_ints_ir: SuperBlockIntsIR | None = field(default=None, repr=False)
    # weight rows of the q8 layer kernel's tile for one token (numba_moe_q8.matmul_q8), and on
    # rows of fewer than numba_moe_q8.SHORT_ROW_WEIGHTS weights (a Qwen3-30B-A3B down row: 768)
    one_token_rows: int = 4
    short_row_rows: int = 4

    def __post_init__(self) -> None:
        if self.int8_block_ir is not None and self.pieces != 1:
            raise ValueError(f"{self.name}: only single-piece blocks have int8_block_ir")
        if self.nibble_block_ir is not None and self.int8_block_ir is None:
            raise ValueError(f"{self.name}: nibble_block_ir needs int8_block_ir (a row's tail)")
        if self.superblock_ints_ir is not None and self.pieces == 1:
            raise ValueError(f"{self.name}: only super-blocks have superblock_ints_ir")
        if self.pieces < 1 or (self.pieces > 1 and self.load_weight_ir is not None):
            raise ValueError(
                f"{self.name}: a kernel block is 1 or more pieces of {KERNEL_BLOCK} weights, "
                f"and only single pieces may end a row part way, got pieces={self.pieces}"
            )

    @property
    def block_weights(self) -> int:
        """Weights of one block: a row of n weights takes n * block_bytes // block_weights
        bytes (whole blocks, or for a dense format any n)."""
        return self.pieces * KERNEL_BLOCK

    @property
    def partial_blocks(self) -> bool:
        """Whether a row may end in part of a block (then read with load_weight_ir)."""
        return self.load_weight_ir is not None


@dataclass(frozen=True)
class WeightFormat:
    """How a weight matrix [..., n] is stored. `quantize` turns a float tensor [..., n] into a
    contiguous tensor of `stored_shape` and `storage_dtype`, without modifying its input (for
    f32/bf16 it is a cast, and returns the input itself when already so stored); `dequantize`
    turns that back into float [..., n], exactly the values the stored tensor represents.
    `kernel` is how the fused CPU kernel reads the same bytes. A format without a quantiser
    (`quantize_fn` None: the k-quants, whose ggml quantisers search scales and are not
    reproduced here) is still stored, loaded and computed with (a GGUF file brings its
    bytes); `can_quantize` says which, and `--expert-format` offers only those."""

    name: str
    block_size: int  # weights per block along a row
    block_bytes: int  # bytes per block
    storage_dtype: torch.dtype
    quantize_fn: Callable[[torch.Tensor], torch.Tensor] | None = field(repr=False)
    dequantize_fn: Callable[..., torch.Tensor] = field(repr=False)  # (q, dtype) -> float
    kernel: KernelFormat = field(repr=False)
    # byte offsets in a block of its scales (d, and m or dmin where it has one), each a
    # `scale_dtype` (fp16; mxfp4's exponent byte: float8_e8m0fnu): any bytes with small finite
    # values there are valid weights (what tests and benchmarks fill)
    scale_offsets: tuple[int, ...] = ()
    scale_dtype: torch.dtype = torch.float16
    # stored [..., nb * block_bytes] -> (int8 [..., nb, 32], float32 [..., nb]): each block's
    # weights exactly as scale * integers (|v| <= 127); the torch side of kernel.int8_block_ir
    int8_blocks_fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = field(
        default=None, repr=False
    )
    # stored [..., nsb * block_bytes] -> quant/_kquants.SuperBlockInts: each 256-weight
    # super-block as integers and its float d (and dmin); the torch side of
    # kernel.superblock_ints_ir
    superblock_ints_fn: Callable[[torch.Tensor], Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.int8_blocks_fn is None) != (self.kernel.int8_block_ir is None):
            raise ValueError(f"{self.name}: int8_blocks_fn and int8_block_ir go together")
        if (self.superblock_ints_fn is None) != (self.kernel.superblock_ints_ir is None):
            raise ValueError(f"{self.name}: superblock_ints_fn and its IR go together")
        if self.block_bytes % self.storage_dtype.itemsize:
            raise ValueError(f"{self.name}: {self.block_bytes} bytes is not whole elements")
        self._check_kernel()

    def _check_kernel(self) -> None:
        """ValueError unless `kernel` reads the rows this format stores."""
        kernel_weights = self.kernel.block_weights
        if kernel_weights % self.block_size:
            raise ValueError(
                f"{self.name}: blocks of {self.block_size} weights do not tile "
                f"the kernel's blocks of {kernel_weights}"
            )
        kernel_bytes = kernel_weights // self.block_size * self.block_bytes
        if (self.kernel.name, self.kernel.block_bytes) != (self.name, kernel_bytes):
            raise ValueError(
                f"{self.name}: {self.kernel} should be named {self.name!r} and "
                f"read {kernel_bytes} bytes a block"
            )
        if self.kernel.partial_blocks != (self.block_size < KERNEL_BLOCK):
            raise ValueError(
                f"{self.name}: needs load_weight_ir exactly when its rows may end "
                "in part of a kernel block"
            )

    @property
    def is_quantized(self) -> bool:
        return self.block_size > 1

    @property
    def has_int8_blocks(self) -> bool:
        """Whether a block is 32 integers and one scale (int8_blocks): the formats whose
        projections take integer dot products with q8 activations (activation_quant)."""
        return self.int8_blocks_fn is not None

    def int8_blocks(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored tensor q [..., nb * block_bytes] -> (int8 values [..., nb, 32], float32
        scales [..., nb]): weight = scale * value exactly. ValueError for a format without."""
        if self.int8_blocks_fn is None:
            raise ValueError(f"{self.name}: its blocks are not 32 integers and one scale")
        return self.int8_blocks_fn(q)

    @property
    def has_superblock_ints(self) -> bool:
        """Whether a super-block reads as integers (superblock_ints): the k-quants whose
        projections take integer dot products with q8 activations (q2_k ... q6_k)."""
        return self.superblock_ints_fn is not None

    def superblock_ints(self, q: torch.Tensor) -> Any:
        """The stored tensor q [..., nsb * block_bytes] -> quant/_kquants.SuperBlockInts.
        ValueError for a format without."""
        if self.superblock_ints_fn is None:
            raise ValueError(f"{self.name}: its super-blocks have no integer form")
        return self.superblock_ints_fn(q)

    @property
    def has_integer_dots(self) -> bool:
        """Whether activation_quant q8 computes this format's projections by integer dot
        products (int8 blocks or integer super-blocks)."""
        return self.has_int8_blocks or self.has_superblock_ints

    @property
    def can_quantize(self) -> bool:
        """Whether float weights can be converted to this format (`quantize`)."""
        return self.quantize_fn is not None

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
        if self.quantize_fn is None:
            quantisable = ", ".join(f.name for f in WEIGHT_FORMATS.values() if f.can_quantize)
            raise ValueError(
                f"{self.name}: no quantiser (weights in {self.name} come from GGUF files); "
                f"convert to one of {quantisable}"
            )
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


WEIGHT_FORMATS: dict[str, WeightFormat] = {}  # by name, in registration order


def register_format(fmt: WeightFormat) -> WeightFormat:
    """Adds `fmt` to WEIGHT_FORMATS and returns it; ValueError if its name is taken."""
    return add_entry(WEIGHT_FORMATS, "weight format", fmt.name, fmt)


def weight_format(name: str) -> WeightFormat:
    """The registered format called `name`; ValueError listing the choices otherwise."""
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        choices = ", ".join(WEIGHT_FORMATS)
        raise ValueError(f"unknown weight format {name!r}; choose one of {choices}") from None


def dense_format(dtype: torch.dtype) -> WeightFormat:
    """The unquantised format of dtype: float32 -> f32, bfloat16 -> bf16, float16 -> f16;
    ValueError otherwise."""
    for fmt in WEIGHT_FORMATS.values():
        if not fmt.is_quantized and fmt.storage_dtype == dtype:
            return fmt
    raise ValueError(f"no dense weight format stores {dtype}; use float32, bfloat16 or float16")
