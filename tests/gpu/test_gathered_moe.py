"""gathered_moe, the accelerator's decode expert math, on the device against bank_moe, the
reference, on the CPU: every weight format, odd routings, several gather chunks; and it never
waits for the device."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels import torch_moe
from hybridmoe.kernels.torch_moe import gathered_moe
from hybridmoe.moe.cpu_experts import bank_moe
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format
from hybridmoe.quant.slot_banks import SlotBanks
from random_weights import random_bank, random_stored

from .device_helpers import sync_debug_mode

E, H, INTER = 8, 128, 64  # the k-quants (no quantiser): random blocks of K_SIZE x K_SIZE
K_SIZE = 256
FORMATS = sorted(WEIGHT_FORMATS)
# Max |difference| relative to max |reference|. Both sides dequantise the same stored weights to
# x's dtype and differ in summation order; in bf16 also in the rounding of intermediates.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def make_bank(fmt: str, seed: int = 0) -> ExpertBank:
    if not weight_format(fmt).can_quantize:
        return random_bank(fmt, E, K_SIZE, K_SIZE, seed)
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5
    dense = ExpertBank(gate_up, torch.randn(E, H, INTER, generator=gen) / INTER**0.5)
    return dense.converted(weight_format(fmt))


def make_routes(tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] with repeats and some -1 (skipped routes), weights [T, K]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, E, (tokens, top_k), generator=gen)
    return ids, torch.rand(tokens, top_k, generator=gen)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    scale = expected.abs().max().clamp(min=1e-6)
    err = ((actual.float().cpu() - expected.float()).abs().max() / scale).item()
    assert err <= REL_TOL[dtype], f"{what}: max relative difference {err:.3g} > {REL_TOL[dtype]}"


def on_device(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (1, 8), (3, 2), (16, 4)])
def test_matches_the_cpu_reference(device, fmt, dtype, tokens, top_k) -> None:
    bank = make_bank(fmt)
    hidden = bank.hidden_size
    ids, weights = make_routes(tokens, top_k, seed=tokens * 10 + top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    weights = weights.to(dtype)
    x_dev, ids_dev, weights_dev = on_device(device, x, ids, weights)
    out = gathered_moe(x_dev, ids_dev, weights_dev, bank.to(device))
    # the float32 partial of the accumulation contract: the layer rounds it once
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32 and out.device == device
    expected = bank_moe(x, ids, weights, bank)
    assert_close(out, expected, dtype, f"{fmt} {dtype} T={tokens} K={top_k}")


@pytest.mark.parametrize("fmt", ["f32", "q4_0"])
def test_routes_split_into_several_chunks_give_the_same_sum(device, fmt, monkeypatch) -> None:
    bank = make_bank(fmt, seed=1)
    ids, weights = make_routes(5, 3, seed=7)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    expert_bytes = 3 * INTER * H * x.element_size()
    monkeypatch.setattr(torch_moe, "GATHER_CHUNK_BYTES", 2 * expert_bytes)  # 2 routes a chunk
    out = gathered_moe(*on_device(device, x, ids, weights), bank.to(device))
    assert_close(out, bank_moe(x, ids, weights, bank), torch.float32, f"{fmt} chunked")


@pytest.mark.cuda_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_never_synchronises_with_the_host(device, fmt) -> None:
    """CUDA's sync debug mode raises on any op that makes the host wait for the device."""
    bank_dev = make_bank(fmt).to(device)
    ids, weights = make_routes(4, 4, seed=3)
    x = torch.randn(4, bank_dev.hidden_size)
    x_dev, ids_dev, weights_dev = on_device(device, x, ids, weights)
    gathered_moe(x_dev, ids_dev, weights_dev, bank_dev)  # first call: lazy initialisation
    torch.cuda.synchronize(device)
    with sync_debug_mode("error"):
        gathered_moe(x_dev, ids_dev, weights_dev, bank_dev)
    torch.cuda.synchronize(device)


MIXED_PAIRS = [("q4_k", "q6_k"), ("q4_k", "q5_k"), ("q5_k", "q6_k")]  # Q4_K_M / Q5_K_M files


def mixed_bank(gate_up: str, down: str, seed: int) -> ExpertBank:
    """Random blocks, gate/up in `gate_up`, down in `down` (a GGUF's separate layout)."""
    gen = torch.Generator().manual_seed(seed)
    fmt, down_fmt = weight_format(gate_up), weight_format(down)
    gate, up = (random_stored(fmt, (E, K_SIZE, K_SIZE), gen) for _ in range(2))
    down_w = random_stored(down_fmt, (E, K_SIZE, K_SIZE), gen)
    return ExpertBank(gate=gate, up=up, down=down_w, fmt=fmt, down_fmt=down_fmt)


@pytest.mark.parametrize("pair", MIXED_PAIRS, ids=["-".join(p) for p in MIXED_PAIRS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_formats_on_shared_slots_match_the_cpu_reference(device, pair, dtype) -> None:
    """A bank with down in another format, computed from device slots sized for a larger
    layer (SlotBanks: the views a cache shares between layers of different formats)."""
    bank = mixed_bank(*pair, seed=3)
    larger = mixed_bank("q6_k", "q6_k", seed=4)
    slots = SlotBanks([bank, larger], E, device)
    for src, dst in bank.copies_into(slots.bank_for(bank)):
        dst.copy_(src)
    ids, weights = make_routes(3, 4, seed=11)
    x = torch.randn(3, K_SIZE, generator=torch.Generator().manual_seed(5)).to(dtype)
    weights = weights.to(dtype)
    x_dev, ids_dev, weights_dev = on_device(device, x, ids, weights)
    out = gathered_moe(x_dev, ids_dev, weights_dev, slots.bank_for(bank))
    assert_close(out, bank_moe(x, ids, weights, bank), dtype, f"{pair} {dtype} on slots")
