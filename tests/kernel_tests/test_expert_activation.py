"""Experts with biases and gpt-oss's clamped SwiGLU (quant/expert_math.py) in every expert
kernel: the torch activation against `transformers`' own GptOssExperts._apply_gate, bank_moe
against a transcription of GptOssExperts.forward, and the numba kernel, gathered_moe and
cache slots against bank_moe."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from hybridmoe.kernels.torch_moe import gathered_moe
from hybridmoe.moe.cpu_experts import bank_moe, fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.expert_math import SILU, ExpertActivation, ExpertBiases
from hybridmoe.quant.formats import weight_format
from rounding import assert_same_rounding

E, H, INTER = 6, 64, 32
ALPHA, LIMIT = 1.702, 1.5  # a small limit: the clamp cuts a good share of the values
CLAMPED = ExpertActivation("clamped_swiglu", ALPHA, LIMIT)
FP32_TOL = dict(rtol=1e-4, atol=1e-5)
FORMATS = ("f32", "bf16", "q8_0")


def make_bank(fmt: str = "f32", activation=CLAMPED, bias: bool = True, seed: int = 0):
    """Random experts whose projections reach well past LIMIT, biases of the same size."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter = H, INTER
    gate_up = torch.randn(E, 2 * inter, hidden, generator=g) * 2 / hidden**0.5
    down = torch.randn(E, hidden, inter, generator=g) / inter**0.5
    biases = None
    if bias:
        biases = ExpertBiases(
            torch.randn(E, 2 * inter, generator=g), torch.randn(E, hidden, generator=g)
        )
    dense = ExpertBank(gate_up, down, biases=biases, activation=activation)
    return dense if fmt == "f32" else dense.converted(weight_format(fmt))


def routes(tokens: int, top_k: int, seed: int, skip: bool = True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    if skip and tokens * top_k > 1:
        ids[0, -1] = -1  # a route the CPU side does not own
    return ids, torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)


def x_for(tokens: int, hidden: int = H, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_is_transformers_apply_gate(dtype) -> None:
    gate_up = (torch.randn(64, 2 * INTER) * 4).to(dtype)  # interleaved, as transformers holds it
    module = SimpleNamespace(alpha=ALPHA, limit=LIMIT)
    expected = GptOssExperts._apply_gate(module, gate_up)
    actual = CLAMPED(gate_up[:, 0::2], gate_up[:, 1::2])
    assert torch.equal(actual, expected)
    assert (gate_up[:, 0::2].abs() > LIMIT).float().mean() > 0.2  # the clamp is exercised


def transformers_moe(x, ids, weights, bank: ExpertBank) -> torch.Tensor:
    """GptOssExperts.forward's math in float32 on the bank's (interleaved back) weights."""
    inter = bank.intermediate_size
    out = torch.zeros(x.shape[0], bank.hidden_size)
    for t in range(x.shape[0]):
        for k, e in enumerate(ids[t].tolist()):
            if e < 0:
                continue
            w_gate_up = torch.stack((bank.gate[e], bank.up[e]), dim=1).reshape(2 * inter, -1)
            b = bank.biases.gate_up[e]
            b_gate_up = torch.stack((b[:inter], b[inter:]), dim=1).reshape(-1)
            gate_up = x[t] @ w_gate_up.T + b_gate_up  # [2I] interleaved
            module = SimpleNamespace(alpha=bank.activation.alpha, limit=bank.activation.limit)
            act = GptOssExperts._apply_gate(module, gate_up[None])[0]
            out[t] += weights[t, k] * (act @ bank.down[e].T + bank.biases.down[e])
    return out


def test_bank_moe_is_transformers_experts_math() -> None:
    bank = make_bank()
    ids, weights = routes(5, 3, seed=0)
    x = x_for(5)
    expected = transformers_moe(x, ids, weights, bank)
    torch.testing.assert_close(bank_moe(x, ids, weights, bank), expected, **FP32_TOL)


def test_biases_and_the_clamp_change_the_result() -> None:
    # guards the tests above and below: dropping either would be caught
    ids, weights = routes(4, 2, seed=3)
    x = x_for(4)
    full = bank_moe(x, ids, weights, make_bank())
    for other in (make_bank(bias=False), make_bank(activation=SILU)):
        assert (bank_moe(x, ids, weights, other) - full).abs().max() > 0.1 * full.abs().max()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
@pytest.mark.parametrize("tokens", [1, 2, 5, 16, 21])
def test_numba_kernel_matches_the_reference(fmt, top_k, tokens) -> None:
    bank = make_bank(fmt)
    ids, weights = routes(tokens, top_k, seed=tokens * 10 + top_k)
    x = x_for(tokens, bank.hidden_size)
    expected = bank_moe(x, ids, weights, bank)
    torch.testing.assert_close(fused_cpu_moe(x, ids, weights, bank), expected, **FP32_TOL)


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_numba_kernel_rounds_bf16_where_the_reference_does(tokens, weights_dtype) -> None:
    bank = make_bank("bf16")
    ids, weights = routes(tokens, 4, seed=tokens)
    x = x_for(tokens).to(torch.bfloat16)
    weights = weights.to(weights_dtype)
    actual, expected = fused_cpu_moe(x, ids, weights, bank), bank_moe(x, ids, weights, bank)
    assert_same_rounding(actual, expected, cancel_steps=2)


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_moe_on_cache_slots_matches_the_reference(fmt, dtype) -> None:
    # the slots get each expert's biases with its weights (ExpertBank.expert_copies)
    bank = make_bank(fmt)
    slots = bank.empty_slots(3, "cpu")
    slot_of = {5: 0, 1: 1, 2: 2}
    for expert, slot in slot_of.items():
        for src, dst in bank.expert_copies(expert, slots, slot):
            dst.copy_(src)
    ids = torch.tensor([[5, 1], [2, -1], [1, 5]])
    slot_ids = torch.tensor([[slot_of.get(e, -1) for e in row] for row in ids.tolist()])
    weights = torch.rand(3, 2).to(dtype)
    x = x_for(3).to(dtype)
    actual, expected = gathered_moe(x, slot_ids, weights, slots), bank_moe(x, ids, weights, bank)
    if dtype == torch.bfloat16:
        assert_same_rounding(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, **FP32_TOL)


def test_a_bank_carries_its_biases_through_moves_and_conversions() -> None:
    bank = make_bank()
    for other in (bank.in_own_pages(), bank.converted(weight_format("q8_0")), bank.views()):
        assert other.activation == CLAMPED
        assert torch.equal(other.biases.gate_up, bank.biases.gate_up)
    assert bank.expert_nbytes == 3 * INTER * H * 4 + (2 * INTER + H) * 4


def test_activation_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="unknown expert activation 'gelu'"):
        ExpertActivation("gelu")


@pytest.mark.parametrize(
    "other",
    [
        dict(bias=False),  # a layer without biases
        dict(activation=SILU),  # a layer with another activation
    ],
)
def test_the_cache_refuses_banks_of_two_kinds_naming_the_layer(other) -> None:
    from hybridmoe.moe.offload_cache import OffloadMoeCache
    from hybridmoe.quant.slot_banks import SlotBanks

    banks = [make_bank(), make_bank(seed=1, **other)]
    with pytest.raises(ValueError, match="layer 1: bank experts .* differ from layer 0's"):
        OffloadMoeCache(banks, num_slots=2, max_fetch=1)
    with pytest.raises(ValueError, match="layer 1: bank experts .* differ from layer 0's"):
        SlotBanks(banks, 2, "cpu")


def test_the_cache_refuses_biases_of_another_dtype() -> None:
    from hybridmoe.quant.slot_banks import SlotBanks

    bank = make_bank()
    other = make_bank(seed=1)
    other.biases = ExpertBiases(other.biases.gate_up.bfloat16(), other.biases.down)
    with pytest.raises(ValueError, match="layer 1: bank experts .* biases"):
        SlotBanks([bank, other], 2, "cpu")
