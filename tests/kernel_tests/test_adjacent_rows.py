"""kernels/projection.adjacent_rows, stack_rows' no-copy path: weights lying back to back in
one storage (a GGUF's q, k and v) stack as the view spanning them, with torch.cat's values and
the separate projections' bits; anything else (a gap, another order, separate storages,
another dtype or row shape, a strided part) is no view, and stack_rows copies as before."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels.projection import DenseProjection, adjacent_rows, stack_rows

H, SIZES = 256, (128, 64, 64)  # hidden, (q, k, v) rows


def _buffer(dtype: torch.dtype, rows: int = sum(SIZES) + 8) -> torch.Tensor:
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(3)).to(dtype)


def _back_to_back(buffer: torch.Tensor, start: int = 0) -> list[torch.Tensor]:
    parts, first = [], start
    for rows in SIZES:
        parts.append(buffer[first : first + rows])
        first += rows
    return parts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_back_to_back_weights_stack_as_a_view_with_the_parts_bits(dtype: torch.dtype) -> None:
    buffer = _buffer(dtype)
    weights = _back_to_back(buffer, start=8)
    want_values = torch.cat(weights)
    parts = [DenseProjection(w) for w in weights]
    x = torch.randn(1, 2, H).to(dtype)
    want = [p(x) for p in parts]
    stacked = stack_rows(parts)
    assert stacked.weight.data_ptr() == buffer[8].data_ptr()  # no copy: the buffer's rows
    assert stacked.weight.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert torch.equal(stacked.weight, want_values)
    got = stacked(x).split(SIZES, dim=-1)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(torch.equal(p(x), w) for p, w in zip(parts, want, strict=True))


def _not_adjacent() -> dict[str, list[torch.Tensor]]:
    buffer = _buffer(torch.bfloat16)
    q, k, v = _back_to_back(buffer)
    wide = _buffer(torch.bfloat16).view(-1, 2 * H)
    return {
        "a gap": [q, k, buffer[sum(SIZES) - 60 : sum(SIZES) + 4]],
        "another order": [q, v, k],
        "separate storages": [q.clone(), k.clone(), v.clone()],
        "another dtype": [q, k.view(torch.float16), v],
        "a strided part": [q, wide[:32, ::2], v],
    }


@pytest.mark.parametrize("case", list(_not_adjacent()))
def test_other_weights_are_no_view_and_stack_rows_copies(case: str) -> None:
    weights = _not_adjacent()[case]
    assert adjacent_rows(weights) is None
    if case in ("another dtype",):
        return  # stack_rows refuses those parts (the format differs)
    want = torch.cat(weights)
    stacked = stack_rows([DenseProjection(w) for w in weights])
    assert stacked.weight.data_ptr() not in {w.data_ptr() for w in weights}
    assert torch.equal(stacked.weight, want)
