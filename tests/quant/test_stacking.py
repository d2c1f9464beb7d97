"""quantize_into (quant/stacking.py), what stacking and converting banks write each expert
matrix with: the bytes of the format's own quantiser, in place in the given rows, for the
formats the numba quantiser writes in place (from bf16 and f32 as stored) and for the others;
and a stacked bank holds every expert's matrices as quantised one by one."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.quant.bank import ExpertBank, ExpertWeights
from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format
from hybridmoe.quant.stacking import quantize_into


@pytest.mark.parametrize("fmt_name", [n for n, f in WEIGHT_FORMATS.items() if f.can_quantize])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_into_writes_the_formats_bytes_in_place(fmt_name, dtype):
    fmt = weight_format(fmt_name)
    w = (torch.randn(2, 8, 512, generator=torch.Generator().manual_seed(1)) * 0.1).to(dtype)
    expected = fmt.quantize(w[1])
    rows = torch.full((2, *expected.shape), 7, dtype=expected.dtype)  # [2, 8, stored row]
    quantize_into(fmt, w[1], rows[0])
    assert torch.equal(rows[0], expected)
    assert (rows[1] == 7).all()  # the rows beside it untouched


@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_0"])
def test_quantize_into_raises_the_quantisers_errors(fmt_name):
    fmt = weight_format(fmt_name)
    w = torch.randn(4, 64)
    w[2, 5] = float("nan")
    out = torch.empty(4, fmt.row_bytes(64), dtype=torch.uint8)
    with pytest.raises(ValueError, match="row 2 has a non-finite weight"):
        quantize_into(fmt, w, out)
    with pytest.raises(ValueError, match="row length 48"):
        quantize_into(fmt, torch.randn(4, 48), out)


@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_0", "bf16"])
def test_stacked_bank_holds_each_matrix_quantised(fmt_name):
    fmt = weight_format(fmt_name)
    g = torch.Generator().manual_seed(2)
    num, hidden, inter = 3, 64, 96
    gate, up = (list(torch.randn(num, inter, hidden, generator=g).bfloat16()) for _ in range(2))
    down = list(torch.randn(num, hidden, inter, generator=g).bfloat16())
    bank = ExpertBank.stack(ExpertWeights(gate, up, down), fmt)
    for e in range(num):
        assert torch.equal(bank.gate[e], fmt.quantize(gate[e]))
        assert torch.equal(bank.up[e], fmt.quantize(up[e]))
        assert torch.equal(bank.down[e], fmt.quantize(down[e]))
