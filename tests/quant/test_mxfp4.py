"""mxfp4 against its two outside references: gguf's numpy MXFP4 (the GGUF block layout, ggml's
values) and transformers' own dequantisation of the Hugging Face layout (gpt-oss's `*_blocks`
and `*_scales`, through bank_from_hf_mxfp4), bit for bit; and the quantiser's rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe.quant.formats import weight_format
from hybridmoe.quant.mxfp4 import doubled_values, e8m0_half
from hybridmoe.quant.mxfp4_hf import bank_from_hf_mxfp4, hf_blocks_to_mxfp4
from mxfp4_layout import hf_layout, random_hf_experts

gguf = pytest.importorskip("gguf")
convert_moe_packed_tensors = pytest.importorskip(
    "transformers.integrations.mxfp4"
).convert_moe_packed_tensors
MXFP4 = weight_format("mxfp4")
QTYPE = gguf.GGMLQuantizationType.MXFP4
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX v1.0, magnitude codes 0..7


def every_exponent_and_byte() -> np.ndarray:
    """Blocks [256 * 16, 17]: each exponent byte 0..255 with each code byte 0..255 (16 blocks
    an exponent, every byte value in some position of them)."""
    blocks = np.zeros((256 * 16, 17), np.uint8)
    blocks[:, 0] = np.repeat(np.arange(256), 16)
    blocks[:, 1:] = (np.arange(256 * 16 * 16).reshape(-1, 16) + np.arange(256 * 16)[:, None]) % 256
    return blocks


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's numpy overflows to inf at e = 255
def test_every_exponent_and_code_is_gguf_bit_for_bit() -> None:
    raw = every_exponent_and_byte().reshape(16, -1)  # rows of 256 blocks
    theirs = gguf.quants.dequantize(raw, QTYPE)
    ours = MXFP4.dequantize(torch.from_numpy(raw))
    np.testing.assert_array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))
    by_exponent = theirs.reshape(256, -1)  # [e, 16 blocks of 32]
    # 6 * 2^(e - 127) overflows from e = 253 on: the only non-finite weights
    assert np.isfinite(by_exponent[:253]).all() and np.isinf(by_exponent[253:]).any(axis=1).all()


def test_values_are_the_ocp_table_times_a_power_of_two() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    signed = [*E2M1, *(-v for v in E2M1)]
    assert (doubled_values(codes).float() / 2).tolist() == signed
    e = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(e8m0_half(e).double() * 2, torch.exp2(e.double() - 127))


def test_hf_layout_dequantises_as_transformers() -> None:
    """transformers' convert_moe_packed_tensors -> gate_up [E, H, 2I] (gate in the even
    columns, up in the odd ones: GptOssExperts) and down [E, I, H]; the bank holds their
    transposes, gate's rows then up's. Every exponent of the file is finite here (e <= 254:
    transformers' ldexp in the parameter dtype would make inf of e = 255 more often)."""
    hf = random_hf_experts(experts=3, hidden=64, inter=96, seed=0)
    bank = bank_from_hf_mxfp4(*hf)
    gate_up = convert_moe_packed_tensors(hf[0], hf[1], dtype=torch.float32)  # [E, H, 2I]
    down = convert_moe_packed_tensors(hf[2], hf[3], dtype=torch.float32)  # [E, I, H]
    assert bank.stacked and bank.fmt is MXFP4 and gate_up.abs().max() > 0
    for e in range(bank.num_experts):
        assert torch.equal(bank.gate_weights(e, torch.float32), gate_up[e, :, 0::2].T)
        assert torch.equal(bank.up_weights(e, torch.float32), gate_up[e, :, 1::2].T)
        assert torch.equal(bank.down_weights(e, torch.float32), down[e].T)


def test_hf_layout_round_trips_through_gguf_blocks() -> None:
    """hf_layout (the test's inverse, tests/mxfp4_layout.py) undoes hf_blocks_to_mxfp4."""
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (5, 3, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 256, (5, 3), dtype=torch.uint8, generator=gen)
    stored = hf_blocks_to_mxfp4(blocks, scales)  # [5, 51]
    again = hf_layout(stored)
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)
    # weight 2j is the low nibble of HF's byte j, and weight j the low nibble of GGUF's byte j
    values = MXFP4.dequantize(stored).view(5, 3, 32)
    low_codes = (
        doubled_values(blocks & 0x0F).float() / 2 * torch.exp2(scales.float() - 127)[..., None]
    )
    assert torch.equal(values[..., 0::2], low_codes)


def test_the_bank_is_one_copy_of_the_file_bytes() -> None:
    hf = random_hf_experts(experts=2, hidden=32, inter=64, seed=2)
    bank = bank_from_hf_mxfp4(*hf)
    assert bank.nbytes == sum(t.numel() for t in hf)  # 17 bytes a block, as in the file
    assert all(t.is_contiguous() for t in bank.tensors())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: (t[0][:, :-1], *t[1:]), r"gate_up_proj_blocks \(2, 127, 2, 16\) and "),
        (lambda t: (t[0][..., :8], *t[1:]), r"not \[E, rows, n/32, 16\]"),
        (lambda t: (*t[:2], t[2][:, :-32], t[3][:, :-32]), r"\(2, 32, 2, 16\).*do not pair"),
        (lambda t: (t[0], t[1].to(torch.int32), *t[2:]), "gate_up_proj_scales is torch.int32"),
    ],
)
def test_hf_shapes_that_do_not_pair_are_named(edit, message: str) -> None:
    hf = random_hf_experts(experts=2, hidden=64, inter=64, seed=3)
    with pytest.raises(ValueError, match=message):
        bank_from_hf_mxfp4(*edit(hf))


def test_quantiser_rounds_to_nearest_ties_to_the_smaller_magnitude() -> None:
    """max |x| in [4, 8) gives e = 2 - 2 + 127 = 127 (scale 1): x is rounded among the E2M1 values
    themselves; midpoints go down, beyond 6 clips, -0 and values rounding to 0 are code 0."""
    x = torch.zeros(32)
    x[:14] = torch.tensor(
        [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, -0.25, -2.5, -0.0, -0.2, 5.01]
    )
    q = MXFP4.quantize(x)
    assert q[0] == 127
    back = MXFP4.dequantize(q)
    expected = [4.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -2.0, 0.0, 0.0, 6.0]
    assert back[:14].tolist() == expected
    codes = torch.cat([q[1:] & 0x0F, q[1:] >> 4])
    assert codes[[1, 9, 11, 12]].tolist() == [0, 0, 0, 0]  # no -0 codes


def test_quantiser_exponent_range() -> None:
    """All zeros: e = 0. Large weights fit (no fp16 scale to overflow): max 2^127 gives
    e = 252. Below 2^-125 the exponent would go under 0: e = 0, the weights round to 0 or
    the smallest values."""
    w = torch.zeros(3, 32)
    w[1, 3] = 2.0**127
    w[2, 0] = 2.0**-127
    q = MXFP4.quantize(w).view(3, 17)
    assert q[:, 0].tolist() == [0, 252, 0]
    back = MXFP4.dequantize(q.reshape(3, 17))
    assert back[1, 3] == 2.0**127 and back[2, 0] == 2.0**-127 and not back[0].any()
