"""The numba Q8_0 / Q4_0 quantisers (kernels/numba_quantize.py, what quantize_q8_0 / quantize_q4_0
run on the host) give byte for byte the torch reference's blocks and gguf's, on float32 and
bfloat16 inputs with zeros, signed zeros, ties, rounding midpoints and subnormals, and raise the
reference's errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from hybridmoe.kernels import numba_quantize
from hybridmoe.kernels.numba_quantize import BLOCKS_PER_ITEM, _fp16_bits
from hybridmoe.quant.q4_0 import quantize_q4_0, quantize_q4_0_reference
from hybridmoe.quant.q8_0 import quantize_q8_0, quantize_q8_0_reference

gguf = pytest.importorskip("gguf")

FAST = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0}
REFERENCE = {"q8_0": quantize_q8_0_reference, "q4_0": quantize_q4_0_reference}
GGUF = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def hard_weights(seed: int, dtype: torch.dtype, rows: int = 96, n: int = 1024) -> torch.Tensor:
    """[rows, n]: each row scaled by 10^-44 .. 10^4 (subnormal blocks included), then blocks of
    zeros, -0.0, +a/-a ties for the absmax, and halves that land on rounding midpoints."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-44, 4, rows)[:, None]
    blocks = x.view(rows, -1, 32)  # [rows, n / 32, 32]
    blocks[0, 0] = 0.0
    blocks[1, 0] = -0.0
    blocks[2, 0, :16], blocks[2, 0, 16:] = 1.5, -1.5  # |max| tie, the first one wins
    blocks[3, 0] = torch.arange(32) - 15.5  # halves
    blocks[4, 0] = torch.arange(32) % 17 - 8.0  # q4_0: m = -8 -> d = 1, x * id + 8.5 ties
    blocks[4, 0, 0] = -8.0
    blocks[5, 0] = torch.linspace(-127, 127, 32).round() + 0.5 * (torch.arange(32) % 2)
    blocks[5, 0, 0] = 127.0  # q8_0: d = 1, id = 1: every odd value a roundf midpoint
    blocks[6, 0] = torch.randint(-3, 4, (32,), generator=g) * 2.0**-140  # subnormal multiples
    blocks[7, :4] = torch.randn(4, 32, generator=g) * 1e-39  # subnormal and tiny normal mixes
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("seed", [0, 1])
def test_bytes_equal_the_reference_and_gguf(name, dtype, seed):
    x = hard_weights(seed, dtype)
    assert x.numel() // 32 > 3 * BLOCKS_PER_ITEM  # several parallel work items
    fast = FAST[name](x)
    assert torch.equal(fast, REFERENCE[name](x))
    with np.errstate(all="ignore"):  # gguf's numpy overflows 1 / d of subnormal blocks
        theirs = gguf.quants.quantize(x.float().numpy(), GGUF[name])  # bf16 widens exactly
    if name == "q4_0":  # a block of zeros whose first |max| is a -0.0: gguf's numpy port
        # stores d = +0.0, ggml's C (and the reference) -0.0 (tests/quant/test_gguf_layout.py)
        zero_blocks = (x.float().reshape(-1, 32) == 0).all(dim=1).numpy()
        assert zero_blocks[[0, 32]].all()  # rows 0 and 1 start with one
        theirs.reshape(-1, 18)[zero_blocks, 1] = 0x80
    np.testing.assert_array_equal(fast.numpy(), theirs)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_other_inputs_equal_the_reference(name):
    x = hard_weights(2, torch.float32, rows=8, n=256)
    for w in (x.T.contiguous().T, x.double(), x.half(), x[:, None, :].expand(8, 3, 256)):
        assert torch.equal(FAST[name](w), REFERENCE[name](w))
    three_d = x.view(2, 4, 256)
    assert FAST[name](three_d).shape == REFERENCE[name](three_d).shape
    before = x.clone()
    FAST[name](x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize(
    "bad",
    [float("inf"), float("nan"), -float("inf"), 1e9],  # 1e9: its scale overflows fp16
)
def test_errors_are_the_references(name, bad):
    x = torch.randn(4 * BLOCKS_PER_ITEM, 64)
    x[3 * BLOCKS_PER_ITEM + 7, 40] = bad
    with pytest.raises(ValueError) as expected:
        REFERENCE[name](x)
    with pytest.raises(ValueError, match="row 1543 ") as got:
        FAST[name](x)
    assert str(got.value) == str(expected.value)


@njit
def _fp16_of(bits, out):
    for i in range(bits.shape[0]):
        out[i] = _fp16_bits(bits[i])


def test_fp16_scale_rounds_as_torch():
    """Every exponent, both signs, random mantissas and each rounding midpoint +-1 ulp."""
    g = np.random.default_rng(0)
    midpoints = [(1 << s) * k + (1 << (s - 1)) for s in range(1, 24) for k in (0, 1, 2, 3)]
    low = np.array([m + d for m in midpoints for d in (-1, 0, 1)], np.int64) & 0x7FFFFF
    mantissas = np.concatenate([low, g.integers(0, 1 << 23, 4096), [0, 0x7FFFFF]])
    exponents = np.arange(255, dtype=np.int64)  # 255 (inf, nan) below
    bits = (exponents[:, None] << 23 | mantissas[None, :]).reshape(-1)
    bits = np.concatenate([bits, bits | 1 << 31, [0x7F800000, 0xFF800000]]).astype(np.uint32)
    ours = np.empty(bits.shape[0], np.int64)
    _fp16_of(bits, ours)
    theirs = torch.from_numpy(bits.view(np.float32)).to(torch.float16).view(torch.int16)
    np.testing.assert_array_equal(ours.astype(np.uint16), theirs.numpy().view(np.uint16))


def test_kernels_release_the_gil_and_run_in_parallel():
    for kernel in (numba_quantize.quantize_q8_0_blocks, numba_quantize.quantize_q4_0_blocks):
        assert kernel.targetoptions["nogil"] and kernel.targetoptions["parallel"]


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize(
    "shape", [(32,), (1, 32), (3, 96), (BLOCKS_PER_ITEM + 1, 32), (5, 7, 64), (0, 64)]
)
def test_odd_sizes_equal_the_reference(name, shape):
    """One block, fewer blocks than a work item, a work item and one block more, 1-D and 3-D,
    no rows: every block count the parallel loop can meet."""
    g = torch.Generator().manual_seed(len(shape))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, generator=g).to(dtype)
        assert torch.equal(FAST[name](x), REFERENCE[name](x))


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_rows_of_partial_blocks_are_refused_as_the_reference(name):
    x = torch.randn(4, 48)
    with pytest.raises(ValueError) as expected:
        REFERENCE[name](x)
    with pytest.raises(ValueError, match="row length 48 is not a multiple") as got:
        numba_quantize.quantize(name, x)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_bit_patterns_equal_the_reference(name, dtype):
    """Weights of random bits (every sign, mantissa and exponent up to 2^10, subnormals
    included), blocks scaled apart: no pattern the block arithmetic treats differently."""
    g = np.random.default_rng(7)
    bits = g.integers(0, 1 << 32, size=(64, 1024), dtype=np.uint64).astype(np.uint32)
    exponent = (bits >> 23) & 0xFF
    bits = np.where(exponent > 137, bits & ~np.uint32(0x40000000), bits)  # |x| < 2^11
    x = torch.from_numpy(bits.view(np.float32)).to(dtype)
    assert x.isfinite().all()
    assert torch.equal(FAST[name](x), REFERENCE[name](x))


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_blocks_written_into_given_rows(name):
    """`out`: a bank's rows (a contiguous slice of a larger tensor), filled in place with the
    reference's bytes and nothing around them touched; a bad `out` is refused."""
    x = hard_weights(3, torch.bfloat16, rows=16, n=256)
    expected = REFERENCE[name](x)  # [16, row_bytes]
    bank = torch.full((3, 16, expected.shape[1]), 0xAA, dtype=torch.uint8)
    rows = bank[1]
    assert numba_quantize.quantize(name, x, out=rows) is rows
    assert torch.equal(bank[1], expected)
    assert (bank[0] == 0xAA).all() and (bank[2] == 0xAA).all()
    for bad in (bank[:, :15], bank[1, :, :-1], bank[1].to(torch.int8), bank.transpose(0, 1)[1]):
        with pytest.raises(ValueError, match="out is"):
            numba_quantize.quantize(name, x, out=bad)
