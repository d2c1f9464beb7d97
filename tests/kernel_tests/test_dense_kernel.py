"""The CPU dense projection (kernels/numba_dense.py) against its reference, torch's F.linear on
the weight's exact values (kernels/torch_dense.py): decode-batch token counts, rows and
columns that are not whole 32-weight blocks or work items, with and without a bias."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels.numba_dense import dense_linear, dense_reference, weight_bytes
from hybridmoe.kernels.projection import DenseProjection, stack_rows
from hybridmoe.kernels.torch_dense import dense_linear_torch
from hybridmoe.quant.formats import weight_format
from random_weights import random_stored
from rounding import assert_same_rounding

# (weight format, activation dtype, rows, columns): odd widths for the dense formats (a
# partial last block, a partial last work item), whole blocks for the block formats
CASES = [
    ("bf16", torch.bfloat16, 77, 200),
    ("f32", torch.float32, 77, 200),
    ("bf16", torch.bfloat16, 3, 31),
    ("f32", torch.float32, 65, 96),
    ("bf16", torch.float32, 40, 70),
    ("f16", torch.bfloat16, 33, 45),
    ("q8_0", torch.bfloat16, 70, 96),
    ("q8_0", torch.float32, 33, 64),
    ("q4_0", torch.bfloat16, 70, 96),
    ("q4_0", torch.float32, 31, 160),
    ("q4_k", torch.bfloat16, 18, 512),
    # rows longer than numba_dense.STREAM_MAX_ROW_BYTES: one token's bf16 / f16 rows in groups
    ("bf16", torch.bfloat16, 9, 4111),
    ("f16", torch.float32, 6, 4200),
]


def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.bfloat16:
        assert_same_rounding(actual.float(), expected.float())
    else:
        scale = float(expected.abs().max())
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize(("name", "act_dtype", "rows", "cols"), CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_torch(name, act_dtype, rows, cols, with_bias):
    fmt = weight_format(name)
    gen = torch.Generator().manual_seed(rows * cols)
    stored = random_stored(fmt, (rows, cols), gen)
    bias = (torch.randn(rows, generator=gen) * 3).to(act_dtype) if with_bias else None
    bias_f32 = None if bias is None else bias.float().numpy()
    w_bytes = weight_bytes(stored)
    for tokens in range(1, 17):
        x = torch.randn(1, tokens, cols, generator=gen).to(act_dtype)  # [B, T, n]
        actual = dense_linear(fmt, w_bytes, rows, x, bias_f32)
        check(actual, dense_linear_torch(x, stored, fmt, bias))


def test_kernel_exact_where_no_rounding_can_tip():
    """Small integers: every product and sum is exact in float32, so the kernel and torch must
    agree bit for bit (a wrong row, token or tail weight cannot hide in a tolerance)."""
    gen = torch.Generator().manual_seed(0)
    for name, act_dtype in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        w = torch.randint(-4, 5, (45, 99), generator=gen).to(act_dtype)
        x = torch.randint(-4, 5, (5, 99), generator=gen).to(act_dtype)
        bias = torch.randint(-8, 9, (45,), generator=gen).to(act_dtype)
        actual = dense_linear(weight_format(name), weight_bytes(w), 45, x, bias.float().numpy())
        assert torch.equal(actual, torch.nn.functional.linear(x, w, bias))


def test_kernel_threads_agree():
    """One thread and two give the same bits: each output is one work item's sum."""
    fmt = weight_format("bf16")
    gen = torch.Generator().manual_seed(1)
    stored = random_stored(fmt, (300, 128), gen)
    x = torch.randn(4, 128, generator=gen).bfloat16()
    one = dense_linear(fmt, weight_bytes(stored), 300, x, threads=1)
    assert torch.equal(one, dense_linear(fmt, weight_bytes(stored), 300, x, threads=2))


def test_bad_sizes_are_refused():
    fmt = weight_format("q8_0")
    stored = fmt.quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="weight bytes"):
        dense_linear(fmt, weight_bytes(stored), 9, torch.randn(1, 64))
    with pytest.raises(ValueError, match="not a multiple"):
        dense_linear(fmt, weight_bytes(stored), 8, torch.randn(1, 60))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        dense_linear(fmt, weight_bytes(stored), 8, torch.randn(1, 64).half())


@pytest.mark.parametrize(("name", "act_dtype", "rows", "cols"), CASES)
def test_kernel_matches_scalar_reference_bit_for_bit(name, act_dtype, rows, cols):
    """The vector kernel against dense_reference, its summation order in scalar code: every
    bit, for 1..9 tokens (every group shape and a second round of groups), with a bias."""
    fmt = weight_format(name)
    gen = torch.Generator().manual_seed(rows + cols)
    stored = random_stored(fmt, (rows, cols), gen)
    bias = (torch.randn(rows, generator=gen) * 3).to(act_dtype)
    for tokens in range(1, 10):
        x = torch.randn(tokens, cols, generator=gen).to(act_dtype)
        actual = dense_linear(fmt, weight_bytes(stored), rows, x, bias.float().numpy())
        assert torch.equal(actual, dense_reference(fmt, stored, x, bias)), (name, tokens)


def test_reference_differs_from_another_summation_order():
    """dense_reference states an order: a plain float32 sum of the same products differs from
    it somewhere on random data (so the bit-for-bit test above can fail)."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 1024, generator=gen), torch.randn(2, 1024, generator=gen)
    ours = dense_reference(weight_format("f32"), w, x)
    plain = (x[:, None, :] * w[None]).sum(-1, dtype=torch.float32)
    assert not torch.equal(ours, plain)


@pytest.mark.parametrize(("name", "tokens"), [("q8_0", 5), ("bf16", 1)])
def test_multi_item_threads_agree_with_reference(name: str, tokens: int):
    """A weight of several work items (64 KiB each; one token's bf16 rows, a single stream,
    in items of 256 KiB: numba_dense.STREAM_ITEMS), 1 and 2 threads: the same bits."""
    fmt = weight_format(name)
    gen = torch.Generator().manual_seed(2)
    stored = random_stored(fmt, (1030, 512), gen)
    x = torch.randn(tokens, 512, generator=gen).bfloat16()
    expected = dense_reference(fmt, stored, x)
    for threads in (1, 2):
        assert torch.equal(
            dense_linear(fmt, weight_bytes(stored), 1030, x, threads=threads), expected
        )


@pytest.mark.parametrize("name", ["bf16", "q8_0"])
def test_stacked_projection_parts_are_the_separate_projections(name):
    """stack_rows (q, k, v as one call) gives each part's bits from the CPU kernel, in a
    block format too (tests/layers/test_stacked_qkv.py: bf16 and float32)."""
    fmt = weight_format(name)
    gen = torch.Generator().manual_seed(4)
    parts = [
        DenseProjection(random_stored(fmt, (rows, 256), gen), fmt=fmt, in_features=256)
        for rows in (96, 32, 32)
    ]
    xs = [torch.randn(1, tokens, 256, generator=gen).bfloat16() for tokens in (1, 3, 4)]
    separate = [[part(x) for part in parts] for x in xs]  # each part its own call
    fused = stack_rows(parts)
    assert parts[1].weight.data_ptr() == fused.weight[96:].data_ptr()  # views
    for x, expected in zip(xs, separate, strict=True):
        outs = fused(x).split([96, 32, 32], dim=-1)
        for part, out, before in zip(parts, outs, expected, strict=True):
            assert torch.equal(out, before) and torch.equal(part(x), before)


def test_stacked_projection_refuses_mixed_parts():
    gen = torch.Generator().manual_seed(5)
    a = DenseProjection(torch.randn(8, 64, generator=gen).bfloat16())
    with pytest.raises(ValueError, match="beside a bf16"):
        stack_rows([a, DenseProjection(torch.randn(8, 32, generator=gen).bfloat16())])
    with pytest.raises(ValueError, match="some projections have a bias"):
        biased = DenseProjection(torch.randn(8, 64).bfloat16(), torch.zeros(8).bfloat16())
        stack_rows([a, biased])
