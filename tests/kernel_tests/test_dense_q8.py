"""kernels/numba_dense_q8.py, the dense projection with q8 activations: the kernel against the
contract's torch reference (activation_q8.q8_linear, then the bias and one rounding:
torch_dense's q8 path) for every format with integer dot products, at decode and prefill
token counts, float32 and bfloat16, with and without a bias; the same bits on 1 and 2
threads; DenseProjection's choice of it (set_activation_quant) and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe.kernels import numba_dense
from hybridmoe.kernels.numba_dense_q8 import dense_linear_q8
from hybridmoe.kernels.projection import DenseProjection
from hybridmoe.kernels.torch_dense import dense_linear_torch
from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format
from hybridmoe.quant.random_blocks import random_stored

INTEGER_DOTS = [name for name, fmt in WEIGHT_FORMATS.items() if fmt.has_integer_dots]
ROWS, N = 70, 512  # rows: groups of 4 and 2 and one left; two 256-weight super-blocks a row


def _weight(name: str, seed: int = 0) -> torch.Tensor:
    return random_stored(weight_format(name), (ROWS, N), torch.Generator().manual_seed(seed))


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 summation order (the kernel's tree of lanes is not the reference's:
    ~1e-7 of the largest output), which in bfloat16 moves an output by at most one step."""
    scale = expected.float().abs().max().item()
    step = 2e-6 if expected.dtype is torch.float32 else 1e-2
    torch.testing.assert_close(actual.float(), expected.float(), rtol=step, atol=step * scale)


@pytest.mark.parametrize("name", INTEGER_DOTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_computes_the_reference(name: str, dtype: torch.dtype) -> None:
    stored = _weight(name)
    fmt = weight_format(name)
    w_bytes = numba_dense.weight_bytes(stored)
    bias = torch.randn(ROWS, generator=torch.Generator().manual_seed(1)).to(dtype)
    for tokens in (1, 2, 3, 4, 5, 9, 16, 21):
        x = torch.randn(tokens, N, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        for b in (None, bias):
            expected = dense_linear_torch(x, stored, fmt, b, activation_quant="q8")
            b32 = None if b is None else b.float().numpy()
            outs = [dense_linear_q8(fmt, w_bytes, ROWS, x, b32, t) for t in (1, 2)]
            assert outs[0].dtype is dtype and outs[0].shape == (tokens, ROWS)
            assert torch.equal(outs[0], outs[1]), (tokens, "1 vs 2 threads")
            _close(outs[0], expected)


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q4_0"])
def test_each_token_of_a_prefill_gets_its_own_calls_bits(name: str) -> None:
    """21 tokens, dotted by 2 x 4 tiles and the rest by smaller ones: each token's outputs
    are, bit for bit, those of its own one-token call (4 x 1 tiles). (A k-quant's 1 x 8 tiles,
    numba_moe_q8.WIDE, are not taken here: over a prefill's activations, which do not stay in
    L1, a 464-token prefill's dense q4_k projections took 351-356 ms against 2 x 4's 330-344.)"""
    stored, fmt = _weight(name), weight_format(name)
    w_bytes = numba_dense.weight_bytes(stored)
    x = torch.randn(21, N, generator=torch.Generator().manual_seed(3))
    batched = dense_linear_q8(fmt, w_bytes, ROWS, x, None, 2)
    for t in range(21):
        alone = dense_linear_q8(fmt, w_bytes, ROWS, x[t : t + 1], None, 2)
        assert torch.equal(batched[t : t + 1], alone), f"token {t}"


def test_q8_differs_from_float_activations_by_the_quantisation() -> None:
    stored, fmt = _weight("q4_k"), weight_format("q4_k")
    x = torch.randn(3, N, generator=torch.Generator().manual_seed(5))
    w_bytes = numba_dense.weight_bytes(stored)
    q8 = dense_linear_q8(fmt, w_bytes, ROWS, x)
    floats = numba_dense.dense_linear(fmt, w_bytes, ROWS, x)
    assert not torch.equal(q8, floats)
    torch.testing.assert_close(q8, floats, rtol=0, atol=0.03 * floats.abs().max().item())


def test_projection_takes_q8_where_its_format_has_integer_dots() -> None:
    quantised = DenseProjection(_weight("q6_k"), None, weight_format("q6_k"), N)
    floats = DenseProjection(torch.randn(ROWS, N).bfloat16())
    for mode, expected in (("auto", "q8"), ("q8", "q8"), ("none", "none")):
        quantised.set_activation_quant(mode)
        floats.set_activation_quant(mode)
        assert (quantised.activation_quant, floats.activation_quant) == (expected, "none")
    with pytest.raises(ValueError, match="must be one of auto, none, q8, got 'q4'"):
        quantised.set_activation_quant("q4")


def test_projection_runs_the_kernel_for_any_token_count_with_q8() -> None:
    """torch has no integer matmul (its reference is an einsum): a prefill's many tokens take
    the kernel too, with the reference's values."""
    projection = DenseProjection(_weight("q4_0"), None, weight_format("q4_0"), N)
    x = torch.randn(40, N, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert not projection.uses_kernel(x)
    projection.set_activation_quant("auto")
    assert projection.uses_kernel(x)
    expected = dense_linear_torch(x, projection.weight, projection.fmt, None, "q8")
    _close(projection(x), expected)


def test_float_formats_have_no_q8_kernel() -> None:
    w_bytes = numba_dense.weight_bytes(torch.randn(ROWS, N).bfloat16())
    x = torch.randn(1, N).bfloat16()
    with pytest.raises(ValueError, match="integer-dot format, got bf16"):
        dense_linear_q8(weight_format("bf16"), w_bytes, ROWS, x)


def test_empty_batch() -> None:
    stored, fmt = _weight("q8_0"), weight_format("q8_0")
    out = dense_linear_q8(fmt, numba_dense.weight_bytes(stored), ROWS, torch.empty(0, N))
    assert out.shape == (0, ROWS) and np.isfinite(out.numpy()).all()
