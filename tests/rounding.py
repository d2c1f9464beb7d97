"""Comparing results of the accumulation contract (docs/architecture.md) in bfloat16."""

from __future__ import annotations

import torch


def assert_same_rounding(
    actual: torch.Tensor, expected: torch.Tensor, cancel_steps: int = 0, tipped_rows: int = 0
) -> None:
    """Two float32 partials of the accumulation contract for bf16 activations, rounded once to
    bf16: equal but for the rare value where float32 summation order tips a rounding (at most
    2 values plus 1 % of them, each by at most one bf16 step; which ones depends on the CPU's
    kernels). Rounding intermediates elsewhere (in a bf16 accumulator, or skipping the bf16
    rounding of the projections) misses both bounds. `cancel_steps` > 0 also lets a differing
    value be off by that many bf16 steps of the largest |expected|: a tipped rounding of one
    route's bf16 output moves a sum that cancels to a much smaller value by more than its own
    step. `tipped_rows` > 0 leaves that many rows (tokens), those with the most differing
    values, out of the count (not of the step bound): where float32 summation order tips a bf16
    rounding of an intermediate (a gate or up projection that lands within a float32 ulp or two
    of a bf16 midpoint: torch's GEMM sums a row in another order within a batch of 6 than alone,
    measured on an AVX2 EPYC), each of that token's outputs moves by a fraction of a step and
    many of their roundings tip. A missed rounding point or a bf16 accumulator moves every
    row."""
    assert actual.dtype == expected.dtype == torch.float32
    a, e = actual.to(torch.bfloat16).float(), expected.to(torch.bfloat16).float()
    step = e.abs().clamp(min=2.0**-126) * 2.0**-7  # one bf16 ulp at most, at e's magnitude
    step = step.clamp(min=cancel_steps * 2.0**-8 * float(e.abs().max()))
    differ = a != e
    assert bool(((a - e).abs() <= step).all()), f"max diff {(a - e).abs().max():.3g}"
    if tipped_rows:
        rows = differ.reshape(differ.shape[0], -1)
        kept = torch.ones(rows.shape[0], dtype=torch.bool)
        kept[rows.sum(1).argsort(descending=True)[:tipped_rows]] = False
        differ = rows[kept]
    allowed = 2 + differ.numel() // 100
    assert int(differ.sum()) <= allowed, f"{int(differ.sum())} of {differ.numel()} values differ"


def assert_close_to_bf16(actual: torch.Tensor, expected: torch.Tensor, steps: int = 4) -> None:
    """Two float32 partials for bf16 activations whose rows are long (256 weights and more, the
    k-quants' super-blocks): there a float32 summation order tips some bf16 rounding of the
    intermediates (projections, silu, products) in most calls, and each tipped value moves
    many outputs by a fraction of a step, so assert_same_rounding's count does not hold. Each
    value within `steps` bf16 steps at the output's largest magnitude; a wrong weight, or a
    missed rounding point, is off by far more."""
    assert actual.dtype == expected.dtype == torch.float32
    bound = steps * 2.0**-8 * float(expected.abs().max())
    diff = float((actual - expected).abs().max())
    assert diff <= bound, f"max diff {diff:.3g} > {steps} bf16 steps ({bound:.3g})"
