"""The weight-format registry: typed entries, each format's own module registering it, and
every list of format names derived from it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from hybridmoe.moe.config import EXPERT_FORMATS
from hybridmoe.quant.formats import (
    KERNEL_BLOCK,
    WEIGHT_FORMATS,
    KernelFormat,
    WeightFormat,
    register_format,
    weight_format,
)

FORMATS = list(WEIGHT_FORMATS)
QUANTISERS = [name for name, fmt in WEIGHT_FORMATS.items() if fmt.can_quantize]
FORMAT_MODULES = sorted({f.kernel.dequantize_block_ir.__module__ for f in WEIGHT_FORMATS.values()})


def test_a_second_format_of_a_name_is_refused() -> None:
    before = dict(WEIGHT_FORMATS)
    twin = dataclasses.replace(weight_format("q8_0"))
    with pytest.raises(ValueError, match="'q8_0' is already registered"):
        register_format(twin)
    assert WEIGHT_FORMATS == before and WEIGHT_FORMATS["q8_0"] is before["q8_0"]


@pytest.mark.parametrize("name", QUANTISERS)
def test_every_format_round_trips_through_its_reference(name: str) -> None:
    fmt = weight_format(name)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 96, generator=g) * torch.logspace(-2, 2, 6)[:, None]  # rows of all scales
    q = fmt.quantize(w)
    assert q.shape == fmt.stored_shape(w.shape) and q.dtype == fmt.storage_dtype
    back = fmt.dequantize(q)
    assert back.shape == w.shape and back.dtype == torch.float32
    # the stored values are exactly representable: quantising them again gives the same bytes
    assert torch.equal(fmt.quantize(back), q)
    # within a block quantiser's error of at least 4 bits (test_roundtrip.py has each
    # format's exact bound): an eighth of the block's largest weight, plus fp16 scale slack;
    # mxfp4's FP4 steps of 2 between 4 and 6 and its clipping above 6 (of 8): a quarter
    blocks = w.reshape(-1, KERNEL_BLOCK)
    relative = 1 / 4 if name == "mxfp4" else 1 / 8 + 2**-10
    bound = blocks.abs().amax(dim=1, keepdim=True) * relative
    err = (back.reshape(-1, KERNEL_BLOCK) - blocks).abs()
    assert (err <= bound).all(), f"{name}: max error {float((err - bound).max()):.3g} over"


@pytest.mark.parametrize("name", FORMATS)
def test_the_kernel_descriptor_agrees_with_the_stored_shape(name: str) -> None:
    fmt = weight_format(name)
    kernel = fmt.kernel
    n = 2 * kernel.block_weights
    stored_row = fmt.stored_shape((3, n))[-1] * fmt.storage_dtype.itemsize
    assert kernel.name == name
    assert kernel.block_bytes * 2 == stored_row == fmt.row_bytes(n)
    assert kernel.partial_blocks == (not fmt.is_quantized)  # dense rows may have any length
    assert kernel.block_weights == max(KERNEL_BLOCK, fmt.block_size)  # super-blocks: 256
    assert callable(kernel.dequantize_block_ir)


def test_an_inconsistent_kernel_descriptor_is_refused() -> None:
    with_int8 = weight_format("q8_0")
    ir = with_int8.kernel.dequantize_block_ir
    with pytest.raises(ValueError, match="int8_blocks_fn and int8_block_ir go together"):
        dataclasses.replace(with_int8, kernel=KernelFormat("q8_0", 34, ir))
    nibbles = weight_format("q4_0").kernel.nibble_block_ir
    with pytest.raises(ValueError, match="nibble_block_ir needs int8_block_ir"):
        KernelFormat("q4_0", 18, ir, nibble_block_ir=nibbles)
    # q8_0 without its int8 blocks (activation_q8's), for the descriptor's other checks
    q8_0 = dataclasses.replace(with_int8, int8_blocks_fn=None, kernel=KernelFormat("q8_0", 34, ir))
    with pytest.raises(ValueError, match="read 34 bytes a block"):
        dataclasses.replace(q8_0, kernel=KernelFormat("q8_0", 36, ir))
    with pytest.raises(ValueError, match="should be named 'q8_0'"):
        dataclasses.replace(q8_0, kernel=KernelFormat("q4_0", 34, ir))
    with pytest.raises(ValueError, match="needs load_weight_ir"):
        dataclasses.replace(weight_format("bf16"), kernel=KernelFormat("bf16", 64, ir))
    with pytest.raises(ValueError, match="needs load_weight_ir"):
        dataclasses.replace(q8_0, kernel=KernelFormat("q8_0", 34, ir, load_weight_ir=ir))
    with pytest.raises(ValueError, match="blocks of 48 weights do not tile .* of 256"):
        dataclasses.replace(q8_0, kernel=KernelFormat("q8_0", 34, ir, pieces=8), block_size=48)
    with_ints = weight_format("q4_k")
    with pytest.raises(ValueError, match="superblock_ints_fn and its IR go together"):
        dataclasses.replace(with_ints, kernel=KernelFormat("q4_k", 144, ir, pieces=8))
    with pytest.raises(ValueError, match="only super-blocks have superblock_ints_ir"):
        KernelFormat("q8_0", 34, ir, superblock_ints_ir=ir)
    q4_k = dataclasses.replace(
        with_ints, superblock_ints_fn=None, kernel=KernelFormat("q4_k", 144, ir, pieces=8)
    )
    with pytest.raises(ValueError, match="blocks of 256 weights do not tile .* of 32"):
        dataclasses.replace(q4_k, kernel=KernelFormat("q4_k", 18, ir))
    with pytest.raises(ValueError, match="only single pieces may end a row"):
        KernelFormat("q4_k", 144, ir, load_weight_ir=ir, pieces=8)
    assert isinstance(q8_0, WeightFormat)


def test_choices_come_from_the_registry() -> None:
    assert EXPERT_FORMATS == tuple(QUANTISERS)  # test_formats.py pins the names
    assert "q4_k" in WEIGHT_FORMATS and "q4_k" not in EXPERT_FORMATS


@pytest.mark.parametrize("first", ["hybridmoe.quant.formats", *FORMAT_MODULES])
def test_importing_quant_fills_the_registry_in_order_without_llvm(first: str) -> None:
    """Whichever module of the package is imported first, the registry is complete and in its
    order; the formats' kernel IR needs llvmlite only when numba compiles a kernel."""
    code = (
        f"import sys, {first}\n"
        "from hybridmoe.quant.formats import WEIGHT_FORMATS\n"
        "print(list(WEIGHT_FORMATS), 'llvmlite' in sys.modules, 'numba' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == f"{FORMATS} False False"
