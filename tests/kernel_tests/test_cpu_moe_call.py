"""fused_cpu_moe's per-bank prepared arguments (cpu_experts._BankCall): inputs of the kernel's
dtypes go in as views, others converted, with the same bits either way; the bank's call is
made once, per bank, and not kept past the bank; a layer call is a few aten ops."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hybridmoe import env
from hybridmoe.moe import cpu_experts
from hybridmoe.moe.cpu_experts import fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import weight_format
from op_counting import CountingOps


def _bank(seed: int = 0) -> ExpertBank:
    g = torch.Generator().manual_seed(seed)
    dense = ExpertBank(
        torch.randn(8, 64, 64, generator=g) * 0.1, torch.randn(8, 64, 32, generator=g) * 0.1
    )
    return dense.converted(weight_format("q8_0"))


def _routes(tokens: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(tokens)])  # int64
    return ids, torch.rand(tokens, 3, generator=g), torch.randn(tokens, 64, generator=g)


def test_views_and_conversions_give_the_same_bits():
    bank = _bank()
    ids, weights, x = _routes(4)
    for act_dtype in (torch.float32, torch.bfloat16):
        xa = x.to(act_dtype)
        expected = fused_cpu_moe(xa.contiguous(), ids, weights, bank)
        wide = torch.zeros(4, 128, dtype=act_dtype)
        wide[:, ::2] = xa
        assert torch.equal(fused_cpu_moe(wide[:, ::2], ids, weights, bank), expected)  # strided
        assert torch.equal(fused_cpu_moe(xa, ids.int(), weights, bank), expected)  # int32 ids
        assert torch.equal(fused_cpu_moe(xa, ids.t().contiguous().t(), weights, bank), expected)
        doubled = fused_cpu_moe(xa, ids, weights.double(), bank)  # float64 weights: converted
        assert torch.equal(doubled, expected)
    flipped = fused_cpu_moe(x, ids, weights.flip(1), bank)  # the weights show in the bits
    assert not torch.equal(flipped, fused_cpu_moe(x, ids, weights, bank))


def test_the_bank_call_is_made_once_and_not_kept_past_the_bank():
    bank, other = _bank(0), _bank(1)
    ids, weights, x = _routes(1)
    fused_cpu_moe(x, ids, weights, bank)
    call = cpu_experts._BANK_CALLS[bank]
    fused_cpu_moe(x.bfloat16(), ids, weights.bfloat16(), bank)  # other dtypes: the same call
    assert cpu_experts._BANK_CALLS[bank] is call
    assert not torch.equal(
        fused_cpu_moe(x, ids, weights, other), fused_cpu_moe(x, ids, weights, bank)
    )
    assert cpu_experts._BANK_CALLS[other] is not call
    size = len(cpu_experts._BANK_CALLS)
    bank_ref, call_ref = weakref.ref(bank), weakref.ref(call)
    del bank, call
    gc.collect()
    # the call held no reference to its bank, and went with it (other tests' banks freed by
    # this collection may leave the dictionary too: its size can drop by more than one)
    assert bank_ref() is None and call_ref() is None
    assert len(cpu_experts._BANK_CALLS) <= size - 1
    assert cpu_experts._BANK_CALLS[other] is not None  # a live bank keeps its call


@pytest.mark.parametrize("inference", [False, True])
def test_a_layer_call_is_a_few_aten_ops(inference: bool, monkeypatch):
    """float32 or bf16 x and router weights, int64 ids: the output's from_numpy only (bf16
    inputs are widened by a numba call); with the glue kernels off, torch's converting
    copies, whose result is the same."""
    bank = _bank()
    ids, weights, x = _routes(1)
    for dtype in (torch.float32, torch.bfloat16):
        xa, wa = x.to(dtype), weights.to(dtype)
        fused_cpu_moe(xa, ids, wa, bank)  # the bank's call for these dtypes made
        with torch.inference_mode(inference), CountingOps() as counted:
            actual = fused_cpu_moe(xa, ids, wa, bank)
        assert len(counted.ops) <= 1, counted.ops
        monkeypatch.setenv("HYBRIDMOE_GLUE_KERNELS", "0")
        env.reread_switches()
        try:
            with CountingOps() as copied:
                expected = fused_cpu_moe(xa, ids, wa, bank)
        finally:
            monkeypatch.delenv("HYBRIDMOE_GLUE_KERNELS")
            env.reread_switches()
        assert torch.equal(actual, expected)
        assert len(copied.ops) == (1 if dtype is torch.float32 else 5), copied.ops
