"""kernels/projection.stack_rows and layers/qkv.StackedQKV: q, k and v by one CPU kernel call
give the bits of three separate calls (bf16, float32, a quantised format, with and without a
bias), the parts then share the stacked memory, and a part quantised after stacking is seen."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels.projection import DenseProjection, stack_rows
from hybridmoe.layers.qkv import StackedQKV
from hybridmoe.quant.formats import WEIGHT_FORMATS

H, SIZES = 256, (128, 64, 64)  # hidden, (q, k, v) rows


def _parts(dtype: torch.dtype, bias: bool, seed: int) -> tuple[DenseProjection, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        DenseProjection(
            torch.randn(rows, H, generator=gen).to(dtype),
            torch.randn(rows, generator=gen).to(dtype) if bias else None,
        )
        for rows in SIZES
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 3])
def test_stacked_equals_separate(dtype: torch.dtype, bias: bool, tokens: int) -> None:
    parts = _parts(dtype, bias, seed=tokens)
    x = torch.randn(1, tokens, H).to(dtype)
    assert parts[0].uses_kernel(x)
    want = [p(x) for p in parts]  # separate kernel calls on the weights as loaded
    qkv = StackedQKV.of(parts)
    got = qkv(x)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)
    # the parts now compute from row views of the stacked weight, with the same bits
    stacked_ptr = qkv.stacked.weight.data_ptr()
    assert parts[0].weight.data_ptr() == stacked_ptr
    for p, w in zip(parts, want, strict=True):
        assert p.weight.untyped_storage().data_ptr() == stacked_ptr
        assert torch.equal(p(x), w)
    assert qkv.holds(parts)


def test_quantised_stack_and_a_part_quantised_later() -> None:
    q8 = WEIGHT_FORMATS["q8_0"]
    parts = _parts(torch.bfloat16, False, seed=5)
    for p in parts:
        p.quantize(q8)
    x = torch.randn(1, 2, H).to(torch.bfloat16)
    want = [p(x) for p in parts]
    qkv = StackedQKV.of(parts)
    assert all(torch.equal(g, w) for g, w in zip(qkv(x), want, strict=True))
    fresh = _parts(torch.bfloat16, False, seed=6)
    assert StackedQKV.of(fresh).holds(fresh)
    fresh[1].quantize(q8)  # replaces k's weight: the stack no longer holds it
    assert not StackedQKV.of(_parts(torch.bfloat16, False, 7)).holds(fresh)


def test_mismatched_parts_are_refused() -> None:
    parts = _parts(torch.bfloat16, False, seed=1)
    with pytest.raises(ValueError, match="beside"):
        stack_rows([parts[0], DenseProjection(torch.randn(8, H))])  # float32 beside bf16
    with pytest.raises(ValueError, match="bias"):
        stack_rows([parts[0], _parts(torch.bfloat16, True, seed=2)[1]])
