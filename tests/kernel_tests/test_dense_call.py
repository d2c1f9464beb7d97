"""The dense kernel's prepared call (numba_dense.DenseCall, what DenseProjection keeps per
weight): the bits of dense_linear for any x layout, a few aten ops a call, and prepared again
when the weight changes."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels.numba_dense import DenseCall, dense_linear, weight_bytes
from hybridmoe.kernels.projection import DenseProjection
from hybridmoe.quant.formats import weight_format
from op_counting import CountingOps
from random_weights import random_stored


def _inputs(act_dtype: torch.dtype, cols: int, gen: torch.Generator) -> list[torch.Tensor]:
    """x of 1..5 tokens in the layouts callers hand over: [T, n], [B, T, n], strided, empty."""
    wide = torch.randn(3, 2 * cols, generator=gen).to(act_dtype)
    return [
        torch.randn(1, 1, cols, generator=gen).to(act_dtype),
        torch.randn(5, cols, generator=gen).to(act_dtype),
        wide[:, ::2],  # every other column: not contiguous
        torch.randn(4, cols, generator=gen).to(act_dtype).t().contiguous().t(),  # transposed
        torch.randn(0, cols, generator=gen).to(act_dtype),
    ]


@pytest.mark.parametrize(
    ("name", "act_dtype"),
    [("bf16", torch.bfloat16), ("f32", torch.float32), ("q8_0", torch.bfloat16)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepared_call_is_dense_linear(name, act_dtype, with_bias):
    fmt = weight_format(name)
    gen = torch.Generator().manual_seed(7)
    rows, cols = 45, 64
    stored = random_stored(fmt, (rows, cols), gen)
    bias = torch.randn(rows, generator=gen).to(act_dtype) if with_bias else None
    bias_f32 = None if bias is None else bias.float().numpy()
    call = DenseCall(fmt, weight_bytes(stored), rows, cols, bias_f32)
    for x in _inputs(act_dtype, cols, gen):
        actual = call(x)
        expected = dense_linear(fmt, weight_bytes(stored), rows, x.contiguous(), bias_f32)
        assert actual.dtype == act_dtype and actual.shape == (*x.shape[:-1], rows)
        assert torch.equal(actual, expected), tuple(x.shape)
        assert actual.is_contiguous()


@pytest.mark.parametrize("inference", [False, True])
def test_a_call_is_a_few_aten_ops(inference: bool):
    """One: float32, from_numpy's lift_fresh of the numpy output; bf16, the output tensor's
    empty_like (the kernel writes it by address), in inference_mode (the model's forward's
    mode) or not. The same through DenseProjection (its kernel test adds none)."""
    gen = torch.Generator().manual_seed(8)
    for act_dtype in (torch.bfloat16, torch.float32):
        weight = torch.randn(32, 64, generator=gen).to(act_dtype)
        projection = DenseProjection(weight)
        x = torch.randn(1, 1, 64, generator=gen).to(act_dtype)
        expected = projection(x)  # prepares the call
        with torch.inference_mode(inference), CountingOps() as counted:
            actual = projection(x)
        assert torch.equal(actual, expected)
        assert len(counted.ops) == 1, counted.ops


def test_the_call_is_prepared_once_and_again_when_the_weight_changes():
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(40, 64, generator=gen).bfloat16()
    projection = DenseProjection(weight, torch.randn(40, generator=gen).bfloat16())
    x = torch.randn(2, 64, generator=gen).bfloat16()
    first = projection(x)
    call = projection._host
    assert projection(x).equal(first) and projection._host is call  # kept
    projection.to(torch.device("cpu"))
    assert projection._host is None
    assert projection(x).equal(first)
    q8 = weight_format("q8_0")
    projection.quantize(q8)
    quantised = dense_linear(
        q8, weight_bytes(projection.weight), 40, x, projection.bias.float().numpy()
    )
    assert torch.equal(projection(x), quantised)
    assert not torch.equal(quantised, first)  # the call did change with the weight


def test_a_wrong_width_is_refused():
    fmt = weight_format("bf16")
    call = DenseCall(fmt, weight_bytes(torch.randn(8, 64).bfloat16()), 8, 64)
    with pytest.raises(ValueError, match="64 columns"):
        call(torch.randn(1, 32).bfloat16())
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        call(torch.randn(1, 64).half())
    with pytest.raises(ValueError, match="weight bytes"):
        DenseCall(fmt, weight_bytes(torch.randn(8, 64).bfloat16()), 9, 64)


def test_output_templates_stay_one_op_after_many_shapes():
    """glue.empty keeps a template per shape up to MAX_TEMPLATES; a process that met more
    shapes (a long test session, a server's batch sizes) still makes a kept shape's output
    in one op, not two (the template cache dropped and refilled, not frozen full)."""
    from hybridmoe.kernels import glue

    for n in range(glue.MAX_TEMPLATES + 3):
        glue.empty((1, n + 1), torch.bfloat16)
    glue.empty((7, 3), torch.bfloat16)
    with CountingOps() as counted:
        out = glue.empty((7, 3), torch.bfloat16)
    assert out.shape == (7, 3) and out.dtype == torch.bfloat16
    assert len(counted.ops) == 1, counted.ops
