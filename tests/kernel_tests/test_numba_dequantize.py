"""kernels/numba_dequantize (stored rows expanded to float32 by the kernels' IR) against each
format's torch dequantiser: the same bits for every quantised format, for valid weights and
for arbitrary bytes (NaN and infinite scales included); and the prefill path that uses it
(bank_moe beyond the fused kernel's tokens) and the torch dense projection give the torch
path's bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.kernels import numba_dequantize
from hybridmoe.kernels.numba_dequantize import MIN_WEIGHTS, dequantize_host
from hybridmoe.kernels.torch_dense import dense_linear_torch
from hybridmoe.moe.cpu_experts import FUSED_MAX_TOKENS, bank_moe
from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format
from random_weights import random_bank, random_stored

QUANTISED = [name for name, fmt in WEIGHT_FORMATS.items() if fmt.is_quantized]


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal shapes, NaNs at the same places, every other value's bits equal."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return False
    return torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("name", QUANTISED)
def test_equals_the_torch_dequantiser(name: str) -> None:
    fmt = weight_format(name)
    gen = torch.Generator().manual_seed(len(name))
    stored = random_stored(fmt, (3, 37, 2048), gen)  # 111 rows: not whole work items
    got = dequantize_host(fmt, stored)
    assert got is not None and got.shape == (3, 37, 2048)
    assert _same_bits(got, fmt.dequantize(stored, torch.float32))
    assert torch.equal(dequantize_host(fmt, stored, threads=1), got)  # any thread count


@pytest.mark.parametrize("name", QUANTISED)
def test_arbitrary_bytes_give_the_torch_bits(name: str) -> None:
    """Any bytes, scales that are NaN or infinite included: the same values (NaN where the
    reference has NaN)."""
    fmt = weight_format(name)
    gen = torch.Generator().manual_seed(7)
    nbytes = 2048 // fmt.block_size * fmt.block_bytes
    raw = torch.randint(0, 256, (40, nbytes), dtype=torch.uint8, generator=gen)
    stored = raw.view(fmt.storage_dtype)
    assert _same_bits(dequantize_host(fmt, stored), fmt.dequantize(stored, torch.float32))


def test_the_comparison_can_fail() -> None:
    """A changed byte of one block changes the result where the reference changes."""
    fmt = weight_format("q4_k")
    stored = random_stored(fmt, (32, 2048), torch.Generator().manual_seed(1))
    before = dequantize_host(fmt, stored)
    stored[5, 40] ^= 0x11  # a nibble byte of row 5's first super-block
    after = dequantize_host(fmt, stored)
    assert not _same_bits(after, before)
    assert _same_bits(after, fmt.dequantize(stored, torch.float32))


def test_what_stays_with_torch() -> None:
    """Dense formats, strided or small tensors: None (torch's dequantiser then)."""
    q8 = weight_format("q8_0")
    stored = random_stored(q8, (64, 2048), torch.Generator().manual_seed(2))
    assert dequantize_host(weight_format("bf16"), torch.ones(64, 2048).bfloat16()) is None
    assert dequantize_host(q8, stored[::2]) is None
    small = stored[: MIN_WEIGHTS // 2048 - 1]
    assert small.numel() and dequantize_host(q8, small) is None


@pytest.mark.parametrize("name", ["q8_0", "q4_k", "q6_k"])
def test_prefill_moe_keeps_its_bits(name: str, monkeypatch) -> None:
    """bank_moe beyond FUSED_MAX_TOKENS (a prefill's routed experts) expands each expert by
    the kernel: the same output as with torch's dequantiser."""
    bank = random_bank(name, 4, 512, 256)
    gen = torch.Generator().manual_seed(3)
    tokens = FUSED_MAX_TOKENS + 8
    x = torch.randn(tokens, 512, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    calls = []
    original = numba_dequantize.dequantize_host
    monkeypatch.setattr(
        numba_dequantize, "dequantize_host", lambda *a: calls.append(1) or original(*a)
    )
    fast = bank_moe(x, ids, weights, bank)
    assert calls  # the kernel expanded the experts
    monkeypatch.setattr(numba_dequantize, "dequantize_host", lambda *a: None)
    assert torch.equal(fast, bank_moe(x, ids, weights, bank))


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])  # the --dense-format choices
def test_dense_projection_keeps_its_bits(name: str) -> None:
    """The torch dense projection (a long prefill's, --dense-format) expands by the kernel:
    the bits of F.linear on the torch dequantiser's weights."""
    fmt = weight_format(name)
    gen = torch.Generator().manual_seed(4)
    stored = random_stored(fmt, (256, 1024), gen)
    x = torch.randn(40, 1024, generator=gen).bfloat16()
    want = F.linear(x.float(), fmt.dequantize(stored, torch.float32)).bfloat16()
    assert torch.equal(dense_linear_torch(x, stored, fmt), want)
