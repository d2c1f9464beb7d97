"""mxfp4 in the kernels: the fused numba kernel's block dequantiser (LLVM IR) reads every
exponent and code as the torch reference does, bit for bit, and a bank made from the Hugging
Face layout computes the same layer on every path as the float bank of transformers'
dequantised weights."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from hybridmoe.kernels.numba_simd import tile_dot
from hybridmoe.kernels.torch_moe import gathered_moe
from hybridmoe.moe.cpu_experts import bank_moe, fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import KernelFormat, weight_format
from hybridmoe.quant.mxfp4 import BLOCK_BYTES, dequantize_block_selects_ir
from hybridmoe.quant.mxfp4_hf import bank_from_hf_mxfp4
from mxfp4_layout import random_hf_experts

MXFP4 = weight_format("mxfp4")
# the registered IR (a byte shuffle on AVX2 CPUs) and the portable one (selects), compiled apart
KERNELS = {
    "registered": MXFP4.kernel,
    "selects": KernelFormat("mxfp4", BLOCK_BYTES, dequantize_block_selects_ir),
}
FP32_TOL = dict(rtol=1e-4, atol=1e-5)


def kernel_weights(kernel: KernelFormat):
    """A jitted (blocks, out) -> out[b, j] = weight j of block b as `kernel` reads it: a
    one-block row dotted with the one-hot activation e_j (fma(w, 0, acc) and the lane sum
    add only exact zeros). The format is a closure constant, as in numba_moe."""

    @numba.njit
    def weights(blocks, out):
        x = np.zeros(32, np.float32)
        offs = np.zeros(1, np.int64)
        for j in range(32):
            x[:] = 0.0
            x[j] = 1.0
            for b in range(out.shape[0]):
                tile_dot(kernel, 1, 1, blocks, b * 17, 17, 1, x, offs, 0, out[b, j:], 0, 1)

    return weights


@pytest.mark.parametrize("ir", KERNELS)
def test_the_kernel_reads_every_exponent_and_code_as_the_reference(ir: str) -> None:
    """Exponents 0..252 (2^-127 subnormal scales included) with every code byte; from 253 on
    some weights are inf, which a dot product with zeros turns into nan, so they are left
    to the reference's own test against gguf (tests/quant/test_mxfp4.py)."""
    exponents = np.repeat(np.arange(253, dtype=np.uint8), 16)  # 16 blocks an exponent
    blocks = np.zeros((exponents.size, 17), np.uint8)
    blocks[:, 0] = exponents
    blocks[:, 1:] = (np.arange(exponents.size * 16).reshape(-1, 16) + exponents[:, None]) % 256
    out = np.full((exponents.size, 32), np.nan, np.float32)
    kernel_weights(KERNELS[ir])(blocks.reshape(-1), out)
    expected = MXFP4.dequantize(torch.from_numpy(blocks)).numpy()
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


@pytest.fixture(scope="module")
def hf_banks() -> tuple[ExpertBank, ExpertBank]:
    """(the mxfp4 bank of random HF blocks, the f32 bank of transformers' dequantisation of
    them: gate_up [E, H, 2I] -> gate = the even columns, up = the odd ones, transposed)."""
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    hf = random_hf_experts(experts=8, hidden=64, inter=96, seed=4)
    gate_up = convert(hf[0], hf[1], dtype=torch.float32)  # [E, H, 2I]
    down = convert(hf[2], hf[3], dtype=torch.float32)  # [E, I, H]
    stacked = torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2).transpose(1, 2)
    dense = ExpertBank(stacked.contiguous(), down.transpose(1, 2).contiguous())
    return bank_from_hf_mxfp4(*hf), dense


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_the_hf_bank_computes_transformers_weights_on_every_path(hf_banks, tokens) -> None:
    bank, dense = hf_banks
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, bank.hidden_size, generator=gen) * 0.1
    ids = torch.randint(0, bank.num_experts, (tokens, 4), generator=gen)
    ids[0, 1] = -1  # a skipped route
    weights = torch.rand(tokens, 4, generator=gen)
    expected = bank_moe(x, ids, weights, dense)
    assert torch.equal(bank_moe(x, ids, weights, bank), expected)  # the same float weights
    torch.testing.assert_close(fused_cpu_moe(x, ids, weights, bank), expected, **FP32_TOL)
    torch.testing.assert_close(gathered_moe(x, ids, weights, bank), expected, **FP32_TOL)


@pytest.mark.parametrize(("hidden", "inter"), [(40, 32), (64, 48), (33, 7)])
def test_a_bank_of_rows_not_whole_blocks_is_refused(hidden: int, inter: int) -> None:
    gate_up = torch.zeros(2, 2 * inter, 17 * -(-hidden // 32), dtype=torch.uint8)
    down = torch.zeros(2, hidden, 17 * -(-inter // 32), dtype=torch.uint8)
    bad = hidden if hidden % 32 else inter
    with pytest.raises(ValueError, match=rf"row length {bad} is not a multiple of the mxfp4"):
        ExpertBank(gate_up, down, MXFP4)
