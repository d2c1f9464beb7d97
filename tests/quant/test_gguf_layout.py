"""Bit-exact layout against the `gguf` package's own (de)quantisation, for every registered
format (their names are gguf's type names in lower case).

gguf's numpy code follows ggml's C reference (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`
in ggml-quants.c) to the bit, rounding included: Q8_0 uses `np_roundf`, half away from zero
like C's roundf, and Q4_0 truncates x * id + 8.5 like C's (int8_t) cast. So exact .5 ties need
no avoiding here; `test_ties_follow_c` pins them to C's values independently of gguf. The
k-quants have no quantiser (here or in gguf's numpy): their dequantisation is checked on random
bytes, with finite scales and with any bytes at all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format
from random_weights import random_stored

gguf = pytest.importorskip("gguf")
QTYPES = {name: gguf.GGMLQuantizationType[name.upper()] for name in WEIGHT_FORMATS}
QUANTISERS = [name for name, fmt in WEIGHT_FORMATS.items() if fmt.can_quantize]
BLOCK_FORMATS = [name for name, fmt in WEIGHT_FORMATS.items() if fmt.is_quantized]
BLOCKS_OF_32 = [name for name in QUANTISERS if weight_format(name).is_quantized]


def _weights(seed: int, rows: int = 24, n: int = 256) -> torch.Tensor:
    """Random rows [rows, n] with the blocks that exercise each rule of the schemes."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, n, generator=gen) * torch.logspace(-4, 3, rows)[:, None]
    w[0, :32] = 0.0  # all zeros: d = 0 (q4_0: -0.0), id = 0
    w[1, 40] = 1e4  # one large value dominates its block
    w[2, 64:96] = -torch.rand(32, generator=gen)  # all negative: q4_0 d > 0
    w[2, 70] = -3.0  # negative max
    w[3, 96], w[3, 100] = -2.0, 2.0  # |max| tie, negative first: q4_0 keeps -2.0
    w[3, 128], w[3, 130] = 2.0, -2.0  # |max| tie, positive first
    w[4, :32] = torch.arange(-16, 16) * 0.25  # an evenly spaced block
    w[4, 32:64] = 0.0  # q8_0 d = 1, id = 1 exactly: x * id lands on exact .5 ties
    w[4, 32:37] = torch.tensor([127.0, 2.5, -2.5, 0.5, -126.5])
    w[4, 64:96] = 0.0  # q4_0 d = 1: x * id + 8.5 lands on exact integers
    w[4, 64:69] = torch.tensor([-8.0, -0.5, 0.5, 7.5, 8.0])
    w[5, :32] = torch.full((32,), 0.5)  # constant block
    return w


@pytest.mark.parametrize("name", QUANTISERS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_bytes_equal_gguf(name: str, seed: int) -> None:
    w = _weights(seed)
    ours = weight_format(name).quantize(w)
    theirs = gguf.quants.quantize(w.numpy(), QTYPES[name])
    np.testing.assert_array_equal(ours.view(torch.uint8).numpy(), theirs.view(np.uint8))


@pytest.mark.parametrize("name", BLOCKS_OF_32)
def test_quantize_bf16_input_equals_gguf_of_its_fp32(name: str) -> None:
    w = _weights(3).to(torch.bfloat16)
    ours = weight_format(name).quantize(w)
    theirs = gguf.quants.quantize(w.float().numpy(), QTYPES[name])
    np.testing.assert_array_equal(ours.numpy(), theirs)


@pytest.mark.parametrize("name", BLOCKS_OF_32)
def test_dequantize_gguf_bytes_equals_gguf(name: str) -> None:
    theirs = gguf.quants.quantize(_weights(4).numpy(), QTYPES[name])
    ours = weight_format(name).dequantize(torch.from_numpy(theirs))
    np.testing.assert_array_equal(ours.numpy(), gguf.quants.dequantize(theirs, QTYPES[name]))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's numpy meets nan scales
@pytest.mark.parametrize("name", [*BLOCK_FORMATS, "f16"])
@pytest.mark.parametrize("seed", [5, 6])
def test_dequantize_random_bytes_equals_gguf(name: str, seed: int) -> None:
    """Any bytes at all (scales nan, inf, subnormal included) decode as gguf decodes them."""
    fmt = weight_format(name)
    row_bytes = fmt.row_bytes(4 * max(fmt.block_size, 32))  # 4 blocks, or 128 f16 weights
    raw = np.random.default_rng(seed).integers(0, 256, (7, row_bytes), dtype=np.uint8)
    stored = torch.from_numpy(raw).view(fmt.storage_dtype)
    ours = fmt.dequantize(stored)
    np.testing.assert_array_equal(ours.numpy(), gguf.quants.dequantize(raw, QTYPES[name]))


@pytest.mark.parametrize("name", BLOCK_FORMATS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dequantize_random_blocks_with_finite_scales_equals_gguf(name: str, seed: int) -> None:
    """The weights tests and benchmarks make: random payloads, finite fp16 scales; all finite
    and equal to gguf's, in every output dtype."""
    fmt = weight_format(name)
    stored = random_stored(fmt, (6, 2 * fmt.block_size * 4), torch.Generator().manual_seed(seed))
    theirs = gguf.quants.dequantize(stored.numpy(), QTYPES[name])
    ours = fmt.dequantize(stored)
    assert np.isfinite(theirs).all() and np.abs(theirs).max() > 0.1
    np.testing.assert_array_equal(ours.numpy(), theirs)
    bf16 = fmt.dequantize(stored, torch.bfloat16)
    assert torch.equal(bf16, torch.from_numpy(theirs).to(torch.bfloat16))


def test_ties_follow_c() -> None:
    """C's roundf rounds half away from zero (torch.round and numpy.round: half to even); q4_0's
    truncation of x / d + 8.5 rounds half up. Values chosen so that d = 1 and id = 1 exactly."""
    x = torch.zeros(32)
    x[:7] = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 126.5, 0.49999997])
    q8 = weight_format("q8_0").quantize(x)
    assert q8[2:9].view(torch.int8).tolist() == [127, 3, -3, 1, -1, 127, 0]

    x = torch.zeros(32)
    x[:6] = torch.tensor([-8.0, -0.5, 0.5, -1.5, 7.5, 8.0])  # m = -8: d = 1
    q4 = weight_format("q4_0").quantize(x)
    low_nibbles = (q4[2:8] & 0x0F).tolist()
    assert low_nibbles == [0, 8, 9, 7, 15, 15]  # v = trunc(x + 8.5), clamped to 15


def test_q4_0_zero_block_scale_is_negative_zero() -> None:
    """ggml's running max starts at +0.0, so d = 0.0 / -8 = -0.0 (bytes 00 80) even when the
    block holds -0.0 (gguf's numpy port would take the -0.0 and store +0.0 there)."""
    q = weight_format("q4_0").quantize(torch.full((32,), -0.0))
    assert q[:2].tolist() == [0x00, 0x80] and (q[2:] == 0x88).all()
