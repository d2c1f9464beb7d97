"""Banks whose down projection is in another format than gate/up (a Q4_K_M GGUF's Q6_K down):
the fused numba kernel, gathered_moe and the slots shared between layers of different formats,
each against the torch reference bank_moe, which is checked against plain float math."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.kernels import numba_moe
from hybridmoe.kernels.torch_moe import (
    DEQUANT_BYTES_PER_WEIGHT,
    gathered_moe,
    gathered_moe_peak_bytes,
)
from hybridmoe.moe.cpu_experts import bank_moe, fused_cpu_moe
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import weight_format
from hybridmoe.quant.slot_banks import SlotBanks
from random_weights import random_stored

# (gate/up, down): a Q4_K_M file's pairs, and dense beside blocks both ways
PAIRS = [("q4_k", "q6_k"), ("q4_k", "q5_k"), ("f32", "q8_0"), ("q4_0", "bf16")]
FP32_TOL = dict(rtol=1e-4, atol=1e-5)


def mixed_bank(
    gate_up: str, down: str, experts=6, hidden=256, inter=256, seed=0, stacked=False
) -> ExpertBank:
    gu_fmt, down_fmt = weight_format(gate_up), weight_format(down)
    gen = torch.Generator().manual_seed(seed)
    down_w = random_stored(down_fmt, (experts, hidden, inter), gen)
    if stacked:
        both = random_stored(gu_fmt, (experts, 2 * inter, hidden), gen)
        return ExpertBank(both, down_w, gu_fmt, down_fmt=down_fmt)
    gate, up = (random_stored(gu_fmt, (experts, inter, hidden), gen) for _ in range(2))
    return ExpertBank(gate=gate, up=up, down=down_w, fmt=gu_fmt, down_fmt=down_fmt)


def routes(tokens: int, top_k: int, experts: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return ids, torch.rand(tokens, top_k, generator=g), torch.randn(tokens, 256, generator=g)


def float_moe(x, ids, weights, bank: ExpertBank) -> torch.Tensor:
    """The same sum from the dequantised float32 matrices, expert by expert."""
    y = torch.zeros(x.shape[0], bank.hidden_size)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate = F.linear(x[t], bank.gate_weights(e, torch.float32))
            up = F.linear(x[t], bank.up_weights(e, torch.float32))
            y[t] += weights[t, k] * F.linear(F.silu(gate) * up, bank.down_weights(e, torch.float32))
    return y


@pytest.mark.parametrize("stacked", [False, True], ids=["separate", "stacked"])
@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_mixed_bank_fused_and_gathered_match_reference(pair, stacked) -> None:
    bank = mixed_bank(*pair, stacked=stacked)
    assert bank.formats == tuple(map(weight_format, pair)) and bank.stacked == stacked
    for tokens in (1, 3, 5):
        ids, weights, x = routes(tokens, 2, bank.num_experts, seed=tokens)
        reference = bank_moe(x, ids, weights, bank)
        torch.testing.assert_close(reference, float_moe(x, ids, weights, bank), **FP32_TOL)
        torch.testing.assert_close(fused_cpu_moe(x, ids, weights, bank), reference, **FP32_TOL)
        torch.testing.assert_close(gathered_moe(x, ids, weights, bank), reference, **FP32_TOL)


def test_mixed_pairs_are_compiled_lazily_under_their_own_name() -> None:
    kernel = numba_moe.fused_moe_kernel("q4_k", "q6_k")
    assert kernel.py_func.__name__ == "fused_moe_q4_k_q6_k"
    assert numba_moe.fused_moe_kernel("q4_k", "q6_k") is kernel
    assert numba_moe.fused_moe_kernel("q8_0", "q8_0") is numba_moe.FUSED_MOE["q8_0"]
    fresh = (
        "import numba, hybridmoe.kernels.numba_moe as m; "
        "print(len(m._MIXED.values())); print(repr(numba.config.CACHE_DIR))"
    )
    out = subprocess.check_output([sys.executable, "-c", fresh], text=True).splitlines()
    assert out[0] == "0"  # importing makes no mixed entry point
    assert out[1] != repr(numba_moe._CACHE_DIR)  # and restores numba's cache directory


def test_slots_hold_experts_of_layers_in_different_formats() -> None:
    """One pool of slots for a Q6_K-down layer and a Q5_K-down layer: each slot sized for the
    larger, read in the formats of the layer whose expert it holds."""
    banks = [mixed_bank("q4_k", "q6_k", seed=1), mixed_bank("q4_k", "q5_k", seed=2)]
    cache = OffloadMoeCache(banks, num_slots=3, max_fetch=3)
    assert SlotBanks.slot_nbytes(banks) == banks[0].expert_nbytes  # q6_k is the larger
    x = torch.randn(1, 256)
    weights = torch.tensor([[0.7, 0.3]])
    for layer, experts in [(0, [1, 4]), (1, [4, 2]), (0, [5, 1]), (1, [0, 2])]:
        ids = torch.tensor([experts])
        slots = ids.clone()
        cache.ensure_experts(layer, slots)
        cache.copy_missing()
        on_slots = gathered_moe(x, slots, weights, cache.slot_bank_for(layer))
        expected = bank_moe(x, ids, weights, banks[layer])
        torch.testing.assert_close(on_slots, expected, **FP32_TOL)
    assert cache.total_stats().evictions > 0  # slots were refilled across formats
    stats = cache.stats_by_layer
    assert stats[1].bytes_copied == stats[1].fetched * banks[1].expert_nbytes


def test_slots_refuse_a_bank_larger_than_they_were_sized_for() -> None:
    slots = SlotBanks([mixed_bank("q4_k", "q5_k")], 2, "cpu")
    with pytest.raises(ValueError, match="more bytes than the slots were sized for"):
        slots.bank_for(mixed_bank("q4_k", "q6_k"))


def test_gathered_peak_counts_a_down_phase_larger_than_gate_up() -> None:
    """Dense gate/up in the activation dtype are used as gathered, but blocks of down are
    expanded: the down phase sets the peak."""
    bank = mixed_bank("f32", "q8_0")
    peak = gathered_moe_peak_bytes(bank, 1, 2, torch.float32)
    down_phase = 2 * (bank.down[0].nbytes + 256 * 256 * DEQUANT_BYTES_PER_WEIGHT)
    assert peak >= down_phase > 2 * (bank.gate[0].nbytes + bank.up[0].nbytes)


def test_a_mixed_bank_has_no_one_format_and_converts_to_one() -> None:
    bank = mixed_bank("q4_k", "q6_k", experts=2)
    with pytest.raises(ValueError, match="gate/up as q4_k and down as q6_k"):
        bank.fmt  # noqa: B018
    dense = bank.converted(weight_format("f32"))
    assert dense.fmt == weight_format("f32")
    torch.testing.assert_close(dense.down, bank.down_weights(torch.arange(2), torch.float32))
    torch.testing.assert_close(dense.gate, bank.gate_weights(torch.arange(2), torch.float32))
