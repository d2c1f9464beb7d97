"""layers/qkv.norm_rotary_qk (q and k normalised and rotated as one tensor) against its
reference (one after the other), kernels/glue.norm_rotary (one numba call on the host, a
prefill's on numba's threads) against the same reference, and rotary.apply_rotary_signed
against apply_rotary: the same bits, at decode and prefill shapes."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.config.model import RopeConfig
from hybridmoe.kernels import glue
from hybridmoe.layers.batch import ForwardBatch
from hybridmoe.layers.qkv import (
    joint_qk_weight,
    norm_rotary_qk,
    norm_rotary_qk_reference,
)
from hybridmoe.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_signed,
    signed_tables,
)


def _batch(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> ForwardBatch:
    cos, sin = RotaryEmbedding(RopeConfig(theta=1e6), head_dim).cos_sin(positions, dtype)
    rows = list(range(positions.shape[0]))
    return ForwardBatch(
        positions, rows, torch.tensor(rows), int(positions.max()) + 1, {}, cos, sin, None
    )


def _views(B: int, T: int, heads: int, kv_heads: int, D: int, dtype: torch.dtype, seed: int):
    """q, k as views of one projection output [B, T, (heads + 2 kv_heads) * D], and weights."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, T, (heads + 2 * kv_heads) * D, generator=gen) * 3).to(dtype)
    q = qkv[..., : heads * D].view(B, T, heads, D)
    k = qkv[..., heads * D : (heads + kv_heads) * D].view(B, T, kv_heads, D)
    q_w = (torch.rand(D, generator=gen) + 0.5).to(dtype)
    k_w = (torch.rand(D, generator=gen) + 0.5).to(dtype)
    positions = torch.randint(0, 4000, (B, 1), generator=gen) + torch.arange(T)  # [B, T]
    return q, k, q_w, k_w, _batch(positions, D, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (1, 17), (2, 5)])  # (B, T)
def test_joint_equals_reference(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    B, T = shape
    heads, kv_heads, D = 8, 2, 64
    q, k, q_w, k_w, batch = _views(B, T, heads, kv_heads, D, dtype, B * 100 + T)
    want_q, want_k = norm_rotary_qk_reference(q, k, q_w, k_w, 1e-6, batch)
    got_q, got_k = norm_rotary_qk(q, k, joint_qk_weight(q_w, k_w, heads, kv_heads), 1e-6, batch)
    assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
    assert got_q.dtype == want_q.dtype == dtype
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_a_wrong_weight_is_seen() -> None:
    """The comparison above can fail: k's weight for the q heads changes q's bits."""
    B, T, heads, kv_heads, D = 1, 1, 4, 2, 32
    q = torch.randn(B, T, heads, D).to(torch.bfloat16)
    k = torch.randn(B, T, kv_heads, D).to(torch.bfloat16)
    q_w, k_w = torch.full((D,), 1.5, dtype=torch.bfloat16), torch.ones(D, dtype=torch.bfloat16)
    batch = _batch(torch.tensor([[7]]), D, torch.bfloat16)
    want_q, _ = norm_rotary_qk_reference(q, k, q_w, k_w, 1e-6, batch)
    got_q, _ = norm_rotary_qk(q, k, joint_qk_weight(k_w, k_w, heads, kv_heads), 1e-6, batch)
    assert not torch.equal(got_q, want_q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_signed_rotary_equals_rotate_half(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 5, 6, 64, generator=gen) * 4).to(dtype)
    # any cos/sin (a scaled rope's, random ones), rounded to the activation dtype
    cos, sin = (torch.randn(2, 2, 5, 64, generator=gen) * 1.3).to(dtype)
    want = apply_rotary(x, cos, sin)
    got = apply_rotary_signed(x, *signed_tables(cos, sin))
    assert got.dtype == want.dtype and torch.equal(got, want)
    # and it can fail: the unsigned sin rotates the other way
    assert not torch.equal(apply_rotary_signed(x, cos.unsqueeze(2), sin.unsqueeze(2)), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 16, 4, 128), (3, 1, 8, 2, 64), (1, 17, 4, 4, 64)])
def test_host_kernel_equals_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """kernels/glue.norm_rotary (one numba call) gives norm_rotary_qk_reference's bits, for q
    and k as views of a projection's output and as tensors of their own."""
    B, T, heads, kv_heads, D = shape
    q, k, q_w, k_w, batch = _views(*shape, dtype, sum(shape))
    want_q, want_k = norm_rotary_qk_reference(q, k, q_w, k_w, 1e-6, batch)
    for q_in, k_in in ((q, k), (q.contiguous(), k.contiguous())):
        got = glue.norm_rotary(q_in, k_in, q_w, k_w, 1e-6, batch.cos, batch.sin)
        assert got is not None  # the kernel ran
        assert got[0].dtype == dtype and got[0].shape == want_q.shape
        assert torch.equal(got[0], want_q) and torch.equal(got[1], want_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 16, 4, 128), (2, 3, 8, 2, 64)])
def test_host_kernel_rotates_only_without_scales(dtype, shape) -> None:
    """Scales None: apply_rotary's bits, q and k each (attention without per-head norms)."""
    q, k, _, _, batch = _views(*shape, dtype, 11 + sum(shape))
    got = glue.norm_rotary(q, k, None, None, 0.0, batch.cos, batch.sin)
    assert got is not None
    assert torch.equal(got[0], apply_rotary(q, batch.cos, batch.sin))
    assert torch.equal(got[1], apply_rotary(k, batch.cos, batch.sin))


def test_host_kernel_can_fail() -> None:
    """The comparison above can fail: k's weight on q's heads, or sin for cos, change q."""
    q, k, q_w, k_w, batch = _views(1, 1, 8, 2, 64, torch.bfloat16, 5)
    want_q, _ = norm_rotary_qk_reference(q, k, q_w, k_w, 1e-6, batch)
    swapped = glue.norm_rotary(q, k, k_w, k_w, 1e-6, batch.cos, batch.sin)
    assert swapped is not None and not torch.equal(swapped[0], want_q)
    crossed = glue.norm_rotary(q, k, q_w, k_w, 1e-6, batch.sin, batch.cos)
    assert crossed is not None and not torch.equal(crossed[0], want_q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 300, 32, 4, 128), (2, 97, 16, 4, 64), (1, 33, 64, 8, 64)])
def test_host_kernel_splits_a_prefill_over_threads(dtype, shape) -> None:
    """Past glue.MAX_NUMEL the tokens run in pieces on numba's threads
    (numba_glue.norm_rotary_rows_parallel): the reference's bits, every token's (counts of
    tokens that do not divide into the pieces included); and rotation without scales too."""
    B, T, heads, kv_heads, D = shape
    assert B * T * (heads + kv_heads) * D > glue.MAX_NUMEL
    q, k, q_w, k_w, batch = _views(*shape, dtype, 3 + sum(shape))
    want_q, want_k = norm_rotary_qk_reference(q, k, q_w, k_w, 1e-6, batch)
    got = glue.norm_rotary(q, k, q_w, k_w, 1e-6, batch.cos, batch.sin)
    assert got is not None  # the kernel ran
    assert torch.equal(got[0], want_q) and torch.equal(got[1], want_k)
    rotated = glue.norm_rotary(q, k, None, None, 0.0, batch.cos, batch.sin)
    assert torch.equal(rotated[0], apply_rotary(q, batch.cos, batch.sin))
    assert torch.equal(rotated[1], apply_rotary(k, batch.cos, batch.sin))
    # and it can fail: each token rotated by its neighbour's sin gives other bits
    shifted = glue.norm_rotary(q, k, q_w, k_w, 1e-6, batch.cos, batch.sin.roll(1, dims=1))
    assert not torch.equal(shifted[0][:, -1], want_q[:, -1])


def test_host_kernel_limits() -> None:
    """float16, a partial rotary, strided heads and mixed dtypes stay torch."""
    q, k, q_w, k_w, batch = _views(1, 1, 8, 2, 64, torch.bfloat16, 6)
    cos, sin = batch.cos, batch.sin
    assert glue.norm_rotary(q, k, q_w, k_w, 1e-6, cos, sin) is not None
    assert glue.norm_rotary(q.half(), k.half(), q_w.half(), k_w.half(), 1e-6, cos, sin) is None
    assert glue.norm_rotary(q, k, q_w, k_w, 1e-6, cos[..., :32], sin[..., :32]) is None
    assert glue.norm_rotary(q, k, q_w.float(), k_w, 1e-6, cos, sin) is None
    assert glue.norm_rotary(q[:, :, ::2], k, q_w, k_w, 1e-6, cos, sin) is None
