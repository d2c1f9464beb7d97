"""Round-trip error bounds: dequantize(quantize(w)) is within a bound derived from each format's
rounding scheme, element by element, over fixed cases and random shapes (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.quant.formats import weight_format

# fp32 arithmetic in x * (1 / d) (+ 8.5) errs by a few 2^-24 relative, i.e. < 1e-5 of a step d.
FP32_SLACK = 1e-5


def _half_ulp_fp16(d: torch.Tensor) -> torch.Tensor:
    """Largest |fp16(d) - d| for d >= 0: 2^-11 relative for normal fp16, 2^-25 for subnormal."""
    return torch.maximum(d * 2.0**-11, torch.tensor(2.0**-25, dtype=torch.float64))


def q8_0_bound(x: torch.Tensor) -> torch.Tensor:
    """|x - dq(q(x))| for blocks x [B, 32]: q = roundf(x / d) errs by d / 2 and the fp16 scale by
    a half ulp, multiplied by |q| <= min(127, |x| / d + 1/2)."""
    x = x.double()
    d = x.abs().amax(dim=1, keepdim=True) / 127  # [B, 1]
    q_abs = (x.abs() / d.clamp(min=1e-300) + 0.5).clamp(max=127)  # [B, 32]
    return d * (0.5 + FP32_SLACK) + q_abs * _half_ulp_fp16(d)


def q4_0_bound(x: torch.Tensor) -> torch.Tensor:
    """The same for q4_0, d = m / -8 with m the signed value of largest |x|: v = trunc(x / d +
    8.5) rounds x / d half up (error d / 2), except that x / d >= 7.5 (the side opposite m, up to
    x = -m, x / d = 8) is clamped to v = 15, i.e. 7 steps: error up to one step |d|."""
    x = x.double()
    m = x.gather(1, x.abs().argmax(dim=1, keepdim=True))  # [B, 1]
    d = (m / -8).abs()  # [B, 1]
    t = x * (-8 / m.where(m != 0, 1.0))  # [B, 32]: x / d, signed
    step = torch.where(t >= 7.5 - FP32_SLACK, 1.0, 0.5)
    v_abs = (t.abs() + 0.5).clamp(max=8)  # |v - 8|
    return d * (step + FP32_SLACK) + v_abs * _half_ulp_fp16(d)


def bf16_bound(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest with 8 significant bits: relative error <= 2^-8 (normal numbers)."""
    return x.double().abs() * 2.0**-8


def mxfp4_bound(x: torch.Tensor) -> torch.Tensor:
    """mxfp4: s = 2^(floor(log2 max|x|) - 2), so |x| / s <= max|x| / s < 8; E2M1 steps are
    s / 2 below 2 s, s below 4 s, 2 s up to 6 s (error half a step), and |x| > 6 s clips to
    6 s (error |x| - 6 s). Exact: s is a power of two and the rounding compares exactly."""
    x = x.double()
    amax = x.abs().amax(dim=1, keepdim=True)  # [B, 1]
    s = torch.exp2(torch.floor(torch.log2(amax.clamp(min=1e-300))) - 2)  # [B, 1]
    t = x.abs() / s  # [B, 32]
    half_step = torch.where(t <= 2, 0.25, torch.where(t <= 4, 0.5, 1.0))
    return torch.where(t > 6, t - 6, half_step) * s


BOUNDS = {"q8_0": q8_0_bound, "q4_0": q4_0_bound, "bf16": bf16_bound, "mxfp4": mxfp4_bound}


def assert_round_trip_within_bound(name: str, w: torch.Tensor) -> None:
    fmt = weight_format(name)
    back = fmt.dequantize(fmt.quantize(w))
    assert back.shape == w.shape and back.dtype == torch.float32
    x = w.reshape(-1, 32).float()  # the bound sees the input as the quantiser does: in fp32
    err = (back.reshape(-1, 32).double() - x.double()).abs()
    bound = BOUNDS[name](x)
    worst = int((err - bound).argmax()) if err.numel() else 0
    assert (err <= bound).all(), (
        f"{name}: max |err| {err.max():.3e}; worst element {worst}: "
        f"|err| {err.flatten()[worst]:.3e} > bound {bound.flatten()[worst]:.3e}"
    )


@pytest.mark.parametrize("name", BOUNDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_random(name: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 256, generator=gen) * torch.logspace(-3, 2, 256)
    assert_round_trip_within_bound(name, w.to(dtype))


@pytest.mark.parametrize("name", BOUNDS)
def test_round_trip_special_blocks(name: str) -> None:
    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    w[0] = 0.0  # all zeros: d = 0, exact
    w[1, 5] = 1e3  # one outlier dominates the scale
    w[2, 7] = -50.0  # negative max: q4_0's d > 0
    w[3, 0], w[3, 9] = 4.0, -4.0  # |max| tie; q4_0 clamps the second one
    w[4] = torch.linspace(-1, 1, 32)  # q4_0: the opposite end of m lands on the clamp
    w[5] = 1e-6 * w[5]  # scale in fp16's subnormal range
    assert_round_trip_within_bound(name, w)


def test_q4_0_clamp_is_the_worst_case() -> None:
    """-m maps to x / d = 8, stored as 7 steps: the one element whose error is a whole step."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -8.0, 8.0  # d = 1
    fmt = weight_format("q4_0")
    back = fmt.dequantize(fmt.quantize(w))
    assert back[0, :2].tolist() == [-8.0, 7.0]


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(BOUNDS)),
    lead=st.lists(st.integers(1, 4), max_size=2),
    blocks=st.integers(1, 6),
    log_scale=st.floats(-6, 4),  # q4_0's fp16 scale m / 8 overflows from |m| ~ 5e5 up
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_property(
    name: str, lead: list[int], blocks: int, log_scale: float, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(*lead, 32 * blocks, generator=gen) * 10.0**log_scale
    assert_round_trip_within_bound(name, w.to(dtype))
