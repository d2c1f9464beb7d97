"""RotaryEmbedding.table_cos_sin (a decode step's cos/sin: rows of tables grown by chunks)
against cos_sin computed for each position alone, as a decode step computed it before: the
same bits at every position of the tables, for each RoPE type, partial rotary and dtype."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.config.model import RopeConfig
from hybridmoe.layers.rotary import TABLE_CHUNK, RotaryEmbedding

ROPES = {
    "default": (RopeConfig(theta=1e6), 128),
    "default-64": (RopeConfig(theta=1e4), 64),
    "partial": (RopeConfig(theta=1e6, partial_rotary_factor=0.25), 64),
    "linear": (RopeConfig(theta=1e4, rope_type="linear", factor=2.0), 64),
    "llama3": (
        RopeConfig(theta=5e5, rope_type="llama3", factor=8.0, original_max_position=8192),
        64,
    ),
    "yarn": (
        RopeConfig(theta=1.5e5, rope_type="yarn", factor=4.0, original_max_position=4096),
        64,
    ),
}


@pytest.mark.parametrize("kind", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_table_rows_are_cos_sin_of_each_position(kind, dtype) -> None:
    rope, head_dim = ROPES[kind]
    rotary = RotaryEmbedding(rope, head_dim)
    length = 2 * TABLE_CHUNK + 5  # grown twice, past a chunk boundary
    for grow_to in (3, TABLE_CHUNK + 1, length):
        rotary.table_cos_sin(torch.tensor([[grow_to - 1]]), dtype, grow_to)
    cos_all, sin_all = rotary.table_cos_sin(torch.arange(length)[:, None], dtype, length)
    assert cos_all.shape == (length, 1, cos_all.shape[-1]) and cos_all.dtype == dtype
    for p in range(length):
        cos, sin = rotary.cos_sin(torch.tensor([[p]]), dtype)  # [1, 1, R]
        assert torch.equal(cos_all[p], cos[0]) and torch.equal(sin_all[p], sin[0]), p


def test_batched_rows_and_reset_on_to() -> None:
    rope, head_dim = ROPES["default"]
    rotary = RotaryEmbedding(rope, head_dim)
    positions = torch.tensor([[5], [1500], [0]])
    cos, sin = rotary.table_cos_sin(positions, torch.bfloat16, 1501)
    want = rotary.cos_sin(positions, torch.bfloat16)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    assert rotary._tables[torch.bfloat16][0].shape[0] == 2 * TABLE_CHUNK
    rotary.to(torch.device("cpu"))
    assert rotary._tables == {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_rows_slice_is_its_indexed_rows(dtype) -> None:
    """With `starts` (a decode step's positions as ints) one row's cos/sin are a slice of the
    tables: the indexed rows' values and shape, at the first, a chunk's last and a grown
    position; more rows than one index as before."""
    rope, head_dim = ROPES["default"]
    rotary = RotaryEmbedding(rope, head_dim)
    for p in (0, TABLE_CHUNK - 1, TABLE_CHUNK + 7):
        positions = torch.tensor([[p]])
        sliced = rotary.table_cos_sin(positions, dtype, p + 1, (p,))
        indexed = rotary.table_cos_sin(positions, dtype, p + 1)
        for got, want in zip(sliced, indexed, strict=True):
            assert got.shape == want.shape == (1, 1, head_dim) and got.is_contiguous()
            assert torch.equal(got, want), p
    positions = torch.tensor([[3], [9]])
    both = rotary.table_cos_sin(positions, dtype, 10, (3, 9))
    want = rotary.cos_sin(positions, dtype)
    assert all(torch.equal(a, b) for a, b in zip(both, want, strict=True))
