"""gathered_moe (the accelerator's decode expert math) against its reference, bank_moe."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels import torch_moe
from hybridmoe.kernels.torch_moe import gathered_moe
from hybridmoe.moe.cpu_experts import bank_moe
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format
from random_weights import random_bank
from rounding import assert_close_to_bf16, assert_same_rounding

E, H, INTER = 6, 64, 96  # the k-quants: K_H, K_INTER (whole super-blocks of 256)
K_H, K_INTER = 256, 256
FORMATS = sorted(WEIGHT_FORMATS)
# Both sides expand the same stored weights exactly and round where the contract says; in
# float32 they differ in summation order only (bfloat16: see assert_same_rounding).
TOLERANCE = 1e-5


def make_bank(fmt: str, seed: int = 0) -> ExpertBank:
    """Quantised from random floats, or for a format without a quantiser (the k-quants) random
    block bytes of [E, 2 K_INTER, K_H] / [E, K_H, K_INTER]."""
    if not weight_format(fmt).can_quantize:
        return random_bank(fmt, E, K_H, K_INTER, seed)
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=gen) * 0.1
    dense = ExpertBank(gate_up, torch.randn(E, H, INTER, generator=gen) * 0.1)
    return dense.converted(weight_format(fmt))


def make_routes(tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (tokens, top_k), generator=gen)
    return ids, torch.rand(tokens, top_k, generator=gen)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and actual.shape[-1] > H:  # the k-quants' rows of 256
        assert_close_to_bf16(actual, expected)
        return
    if dtype == torch.bfloat16:
        assert_same_rounding(actual, expected)
        return
    scale = expected.abs().max().clamp(min=1e-6)
    err = ((actual.float() - expected.float()).abs().max() / scale).item()
    assert err <= TOLERANCE, f"max relative difference {err:.3g} > {TOLERANCE}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (1, 8), (4, 2), (16, 4)])
def test_matches_the_reference(fmt, dtype, tokens, top_k):
    bank = make_bank(fmt)
    hidden = bank.hidden_size
    ids, weights = make_routes(tokens, top_k, seed=tokens * 10 + top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    weights = weights.to(dtype)
    out = gathered_moe(x, ids, weights, bank)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32  # the partial, unrounded
    assert_close(out, bank_moe(x, ids, weights, bank), dtype)


def test_negative_ids_contribute_nothing_even_with_non_finite_weights():
    bank = make_bank("f32")
    x = torch.randn(3, H)
    ids = torch.tensor([[1, -1], [-1, -1], [2, 2]])  # a row with no route; a duplicate
    weights = torch.tensor([[0.5, float("nan")], [float("inf"), 1.0], [0.25, 0.75]])
    out = gathered_moe(x, ids, weights, bank)
    assert torch.equal(out[1], torch.zeros(H))
    assert_close(out, bank_moe(x, ids, weights.nan_to_num(0.0, 0.0), bank), torch.float32)


def test_chunking_does_not_change_the_result(monkeypatch):
    bank = make_bank("q8_0")
    ids, weights = make_routes(8, 4, seed=3)
    x = torch.randn(8, H)
    whole = gathered_moe(x, ids, weights, bank)
    monkeypatch.setattr(torch_moe, "GATHER_CHUNK_BYTES", 3 * INTER * H * 4 * 3)  # 3 routes a chunk
    assert torch.equal(gathered_moe(x, ids, weights, bank), whole)


@pytest.mark.parametrize("fmt", FORMATS)
def test_never_reads_a_tensor_on_the_host(fmt):
    """On the meta device any read of values (tolist, item, a data-dependent shape) raises, so
    this passing shows the kernel sequence does not depend on the routing."""
    spec = weight_format(fmt)
    h, inter = (H, INTER) if spec.can_quantize else (K_H, K_INTER)

    def meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    bank = ExpertBank(
        meta(spec.stored_shape((E, 2 * inter, h)), spec.storage_dtype),
        meta(spec.stored_shape((E, h, inter)), spec.storage_dtype),
        spec,
    )
    ids, weights = meta((4, 2), torch.int64), meta((4, 2), torch.float32)
    out = gathered_moe(meta((4, h), torch.float32), ids, weights, bank)
    assert out.shape == (4, h) and out.device.type == "meta"
    with pytest.raises(NotImplementedError):
        bank_moe(meta((4, h), torch.float32), ids, weights, bank)  # the reference does read
