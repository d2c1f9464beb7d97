"""The experts' SiLU and sigmoid in vectors (kernels/activation_ir.py) against torch's own
F.silu and torch.sigmoid, bit for bit, over float32 bit patterns spread across all 2^32 and
the special values, in every vector width the kernels use and the one-lane tail; and
numba_moe's activations (float32 and bfloat16 steps) against torch's ops."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybridmoe.kernels import numba_moe as nm
from hybridmoe.kernels.activation_ir import activation_at
from hybridmoe.kernels.glue import softmax_lanes

pytestmark = pytest.mark.skipif(
    softmax_lanes() is None, reason="torch's build here does not use SLEEF's vector exp"
)
SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan, 88.7, -88.7, 100.0, 100.5, -104.0, -104.5, 1e-40]


def bit_patterns(stride: int = 4099) -> np.ndarray:
    """float32 values of every stride-th bit pattern plus SPECIALS, a multiple of 64 long (a
    tensor torch's silu computes in vectors throughout)."""
    values = np.arange(0, 1 << 32, stride, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = np.concatenate([np.array(SPECIALS, np.float32), values])
    return values[: values.shape[0] - values.shape[0] % 64].copy()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


@numba.njit
def _in_widths(values, width, sigmoid):
    """activation_at over values in vectors of `width` (16, 8 or 1), the tail one by one."""
    numba.literally(sigmoid)
    n = values.shape[0]
    whole = n - n % width if width > 1 else 0
    if width == 16:
        for j in range(0, whole, 16):
            activation_at(values, j, 16, sigmoid)
    elif width == 8:
        for j in range(0, whole, 8):
            activation_at(values, j, 8, sigmoid)
    for j in range(whole, n):
        activation_at(values, j, 1, sigmoid)


@pytest.mark.parametrize("width", [16, 8, 1])
@pytest.mark.parametrize("op", ["silu", "sigmoid"])
def test_torch_bits_in_every_width(op: str, width: int) -> None:
    x = bit_patterns()
    expected = (F.silu if op == "silu" else torch.sigmoid)(torch.from_numpy(x.copy())).numpy()
    actual = x.copy()
    _in_widths(actual, width, op == "sigmoid")
    assert same_bits(actual, expected)
    assert np.isnan(actual).sum() > 1000  # the specials reached: NaN, and inf or 0
    assert (actual == np.inf).any() if op == "silu" else (actual == 0).any()


@pytest.mark.parametrize("act_bf16", [False, True])
def test_swiglu_is_torch_silu_times_up(act_bf16: bool) -> None:
    g = torch.Generator().manual_seed(0)
    n = 64 * 40 + 37  # a tail after the last vector
    padded = 64 * 41
    dtype = torch.bfloat16 if act_bf16 else torch.float32
    gate = (torch.randn(padded, generator=g) * 6).to(dtype)
    up = torch.randn(padded, generator=g).to(dtype)
    expected = (F.silu(gate) * up).float().numpy()[:n]  # torch's vector lanes throughout
    actual, up_np = gate.float().numpy().copy(), up.float().numpy().copy()
    nm._swiglu(actual, up_np, n, act_bf16)
    assert same_bits(actual[:n], expected)


def test_the_kernels_use_vectors_here() -> None:
    assert nm.SILU_LANES in (8, 16)


def test_a_wrong_coefficient_is_seen() -> None:
    """The comparison sees one exp off by an ulp: SLEEF's exp against libm's (the kernels'
    previous exp) differs on this sample."""
    x = bit_patterns()
    libm = x.copy()
    for j in range(libm.shape[0]):
        libm[j] = nm._silu(libm[j])
    assert not same_bits(libm, F.silu(torch.from_numpy(x.copy())).numpy())
