"""The fused numba MoE kernel (fused_cpu_moe) against the torch reference (bank_moe), for every
weight format, odd shapes and routing corner cases; its threads and the GIL."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from hybridmoe.kernels.numba_moe import max_threads
from hybridmoe.moe.cpu_experts import (
    FUSED_MAX_ROUTES_FLOAT,
    FUSED_MAX_ROUTES_QUANTIZED,
    FUSED_MAX_TOKENS,
    bank_moe,
    fused_cpu_moe,
    uses_fused_kernel,
)
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format
from random_weights import random_bank, whole_blocks
from rounding import assert_close_to_bf16, assert_same_rounding

FORMATS = tuple(WEIGHT_FORMATS)  # every registered format
QUANTISERS = [name for name, fmt in WEIGHT_FORMATS.items() if fmt.is_quantized and fmt.can_quantize]
# Both sides compute from the same stored (dequantised) weights in fp32: only the summation
# order differs, so the tolerance is fp32's, scaled by the output's magnitude.
FP32_TOL = dict(rtol=1e-4, atol=1e-5)


def make_bank(fmt: str, experts=8, hidden=64, inter=32, seed=0) -> ExpertBank:
    """Quantised from random floats where `fmt` has a quantiser, else (the k-quants) random
    block bytes; hidden and inter rounded up to whole blocks (256 for the k-quants)."""
    if not weight_format(fmt).can_quantize:
        return random_bank(fmt, experts, whole_blocks(hidden, fmt), whole_blocks(inter, fmt), seed)
    g = torch.Generator().manual_seed(seed)
    dense = ExpertBank(
        torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1,
        torch.randn(experts, hidden, inter, generator=g) * 0.1,
    )
    return dense if fmt == "f32" else dense.converted(weight_format(fmt))


def make_routes(tokens: int, top_k: int, experts: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return ids, weights


def x_for(bank: ExpertBank, tokens: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, bank.hidden_size, generator=g)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 9, 16])
def test_fused_kernel_matches_reference(fmt: str, tokens: int) -> None:
    bank = make_bank(fmt)
    ids, weights = make_routes(tokens, top_k=3, experts=bank.num_experts, seed=tokens)
    x = x_for(bank, tokens)
    torch.testing.assert_close(
        fused_cpu_moe(x, ids, weights, bank), bank_moe(x, ids, weights, bank), **FP32_TOL
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_routing_corner_cases(fmt: str) -> None:
    bank = make_bank(fmt)
    x = x_for(bank, 4)
    weights = torch.rand(4, 2)
    cases = {
        "all skipped": torch.full((4, 2), -1),
        "duplicate ids in a row": torch.tensor([[3, 3], [1, 1], [0, 5], [5, 0]]),
        "some skipped": torch.tensor([[-1, 2], [2, -1], [-1, -1], [7, 0]]),
        "one expert for all": torch.full((4, 2), 6),
    }
    for name, ids in cases.items():
        out = fused_cpu_moe(x, ids, weights, bank)
        torch.testing.assert_close(out, bank_moe(x, ids, weights, bank), **FP32_TOL, msg=name)
    assert not fused_cpu_moe(x, cases["all skipped"], weights, bank).any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 7, 16])
def test_every_top_k_with_skipped_routes(fmt: str, tokens: int) -> None:
    """K = 1..8, a random quarter of the routes skipped (id -1), on random block bytes for
    every block format (every bit pattern of the payload, not only what a quantiser writes)."""
    fmt_ = weight_format(fmt)
    size = max(fmt_.block_size, 64)
    bank = random_bank(fmt, 12, size, whole_blocks(32, fmt), seed=tokens)
    for top_k in range(1, 9):
        ids, weights = make_routes(tokens, top_k, bank.num_experts, seed=top_k)
        skip = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(top_k)) < 0.25
        ids = torch.where(skip, -1, ids)
        x = x_for(bank, tokens)
        expected = bank_moe(x, ids, weights, bank)
        torch.testing.assert_close(
            fused_cpu_moe(x, ids, weights, bank), expected, **FP32_TOL, msg=f"K={top_k}"
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_top_k_one_and_many_experts(fmt: str) -> None:
    bank = make_bank(fmt, experts=40)
    for tokens, top_k in ((1, 1), (7, 1), (2, 12)):
        ids, weights = make_routes(tokens, top_k, bank.num_experts, seed=tokens)
        x = x_for(bank, tokens)
        expected = bank_moe(x, ids, weights, bank)
        torch.testing.assert_close(fused_cpu_moe(x, ids, weights, bank), expected, **FP32_TOL)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize(("hidden", "inter"), [(40, 24), (33, 7), (96, 50)])
def test_dense_rows_with_a_partial_block(fmt: str, hidden: int, inter: int) -> None:
    bank = make_bank(fmt, hidden=hidden, inter=inter)
    ids, weights = make_routes(5, 2, bank.num_experts)
    x = x_for(bank, 5)
    torch.testing.assert_close(
        fused_cpu_moe(x, ids, weights, bank), bank_moe(x, ids, weights, bank), **FP32_TOL
    )


@pytest.mark.parametrize("fmt", QUANTISERS)
def test_quantised_rows_must_be_whole_blocks(fmt: str) -> None:
    with pytest.raises(ValueError, match="hidden_size.*40"):
        make_bank(fmt, hidden=40, inter=32)
    with pytest.raises(ValueError, match="moe_intermediate_size.*24"):
        make_bank(fmt, hidden=64, inter=24)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 3, 16, 24])  # 24: a prefill the kernel keeps
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])  # Mixtral | others
def test_bf16_activations_round_where_the_reference_does(fmt, tokens, weights_dtype) -> None:
    bank = make_bank(fmt, hidden=128, inter=64)
    assert uses_fused_kernel(tokens, 4, bank)  # 24 x 4 routes over 8 experts: 12 each
    ids, weights = make_routes(tokens, 4, bank.num_experts, seed=tokens)
    weights = weights.to(weights_dtype)
    x = x_for(bank, tokens).to(torch.bfloat16)
    actual, expected = fused_cpu_moe(x, ids, weights, bank), bank_moe(x, ids, weights, bank)
    if bank.hidden_size == 128:  # q4_1, 16 tokens: 1 value; q8_0, 16 tokens: a tipped up
        assert_same_rounding(actual, expected, cancel_steps=2, tipped_rows=tokens // 8)
    else:
        assert_close_to_bf16(actual, expected)  # the k-quants' 256-weight rows


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "f32"])
def test_rows_left_out_of_the_count_still_catch_a_missed_rounding(fmt: str) -> None:
    """The comparison above, 16 tokens and two rows left out: a partial that skips the bf16
    rounding points (the kernel on float32 x of the same values) fails it."""
    bank = make_bank(fmt, hidden=128, inter=64)
    ids, weights = make_routes(16, 4, bank.num_experts, seed=16)
    x = x_for(bank, 16).to(torch.bfloat16)
    unrounded, expected = (
        fused_cpu_moe(x.float(), ids, weights, bank),
        bank_moe(x, ids, weights, bank),
    )
    with pytest.raises(AssertionError):
        assert_same_rounding(unrounded, expected, cancel_steps=2, tipped_rows=2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_sized_calls_take_the_path_of_their_routes_per_expert(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past FUSED_MAX_TOKENS the fused kernel keeps a batch whose experts get at most the
    bank's kind's limit of routes each on average (quantised banks more than float ones);
    bank_moe takes one route beyond. Both give the reference's sums."""
    from hybridmoe.moe import cpu_experts

    bank = make_bank(fmt)
    quantized = bank.gate_up_fmt.is_quantized
    limit = FUSED_MAX_ROUTES_QUANTIZED if quantized else FUSED_MAX_ROUTES_FLOAT
    top_k = 2
    at_limit = limit * bank.num_experts // top_k
    taken = []
    monkeypatch.setattr(cpu_experts, "bank_moe", lambda *a: taken.append(1) or bank_moe(*a))
    for tokens, reference in (
        (FUSED_MAX_TOKENS + 5, False),
        (at_limit, False),
        (at_limit + 1, True),
    ):
        assert uses_fused_kernel(tokens, top_k, bank) is not reference
        ids, weights = make_routes(tokens, top_k, bank.num_experts, seed=tokens)
        x = x_for(bank, tokens)
        taken.clear()
        actual = fused_cpu_moe(x, ids, weights, bank)
        assert bool(taken) is reference, tokens
        torch.testing.assert_close(actual, bank_moe(x, ids, weights, bank), **FP32_TOL)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_fused_kernel_beyond_16_tokens(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel itself (not the prefill path) for 17 and 33 tokens, K = 5, a route skipped."""
    from hybridmoe.moe import cpu_experts

    monkeypatch.setattr(cpu_experts, "FUSED_MAX_TOKENS", 64)
    bank = make_bank(fmt)
    for tokens in (17, 33):
        ids, weights = make_routes(tokens, 5, bank.num_experts, seed=tokens)
        ids[3, 2] = -1
        x = x_for(bank, tokens)
        expected = bank_moe(x, ids, weights, bank)
        torch.testing.assert_close(fused_cpu_moe(x, ids, weights, bank), expected, **FP32_TOL)


def test_out_of_range_id_is_an_index_error() -> None:
    bank = make_bank("q4_0")
    x = x_for(bank, 2)
    with pytest.raises(IndexError, match="expert id 8 out of range.*8 experts"):
        fused_cpu_moe(x, torch.tensor([[0, 8], [1, 2]]), torch.rand(2, 2), bank)


def test_result_does_not_depend_on_the_thread_count() -> None:
    bank = make_bank("q4_0", experts=16, hidden=128, inter=96)
    ids, weights = make_routes(6, 4, bank.num_experts)
    x = x_for(bank, 6)
    results = [fused_cpu_moe(x, ids, weights, bank, threads=n) for n in range(1, max_threads() + 1)]
    for result in results[1:]:
        assert torch.equal(result, results[0])  # each output row is summed in one fixed order


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_calls_create_no_threads() -> None:
    bank = make_bank("q8_0")
    ids, weights = make_routes(2, 2, bank.num_experts)
    x = x_for(bank, 2)
    fused_cpu_moe(x, ids, weights, bank)  # the pool starts on the first call
    before = _os_threads()
    for _ in range(20):
        fused_cpu_moe(x, ids, weights, bank)
    assert _os_threads() == before


def test_the_gil_is_released_while_the_kernel_computes() -> None:
    """A Python loop on this thread keeps running during one long kernel call on another.
    Were the GIL held for the call, the loop would stall for the whole call: its longest
    pause would be the call's duration rather than a small part of it."""
    bank = make_bank("q8_0", experts=16, hidden=1024, inter=512)
    ids, weights = make_routes(16, 16, bank.num_experts)  # every token to every expert
    x = x_for(bank, 16)
    fused_cpu_moe(x, ids, weights, bank, threads=1)  # compile outside the measured call
    go, call_s = threading.Event(), []

    def call() -> None:
        go.wait(10)
        begin = time.perf_counter()
        fused_cpu_moe(x, ids, weights, bank, threads=1)
        call_s.append(time.perf_counter() - begin)

    worker = threading.Thread(target=call)
    worker.start()
    longest_pause, last = 0.0, time.perf_counter()
    go.set()  # this thread is in its loop before the worker can enter the kernel
    while worker.is_alive():
        now = time.perf_counter()
        longest_pause, last = max(longest_pause, now - last), now
    worker.join()
    assert longest_pause < 0.5 * call_s[0], (longest_pause, call_s[0])


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q4_0", "q4_k", "q4_0+q8", "q4_k+q8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_down_layouts_give_the_same_bits(fmt: str, dtype: torch.dtype) -> None:
    """A call of few routes takes the expert-major down projection (numba_moe's
    EXPERT_MAJOR_MAX_ROUTES), a larger one the hidden-major: a token's output is the same bits
    in either (the same additions in the same order), over row chunks of 64 and a partial one.
    The tokens added to make the larger call route to other experts, so that each expert of
    the first two computes the same tile shapes in both calls (one token's bf16 rows take
    another path than a tile's: numba_moe.streams)."""
    from hybridmoe.kernels.numba_moe import EXPERT_MAJOR_MAX_ROUTES

    name, _, quant = fmt.partition("+")
    bank = make_bank(name, experts=16, hidden=160, inter=64, seed=3)
    bank = bank.with_activation_quant(quant) if quant else bank
    top_k, few, many = 8, 2, 10
    assert few * top_k <= EXPERT_MAJOR_MAX_ROUTES < many * top_k <= FUSED_MAX_TOKENS * top_k
    ids, weights = make_routes(many, top_k, 8, seed=5)  # experts 0 .. 7
    ids[few:] += 8  # the others' experts: 8 .. 15
    x = x_for(bank, many).to(dtype)
    alone = fused_cpu_moe(x[:few], ids[:few], weights[:few].to(dtype), bank)
    batched = fused_cpu_moe(x, ids, weights.to(dtype), bank)
    assert torch.equal(alone, batched[:few])


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "q4_0", "q4_k", "q4_0+q8", "q4_k+q8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_gets_the_same_bits_whatever_shares_its_experts(fmt: str, dtype) -> None:
    """Batch invariance: token 0's output alone and in calls of 2 to 5 tokens whose others
    route to some of its experts, so that its rows are dotted by tiles of other shapes (one
    token's bf16 rows by a stream of one row, two tokens' by 4 x 2 tiles, three's by 2 x 3,
    ...: numba_simd's tiles sum a pair in one order whatever their shape)."""
    name, _, quant = fmt.partition("+")
    bank = make_bank(name, experts=16, hidden=160, inter=64, seed=4)
    bank = bank.with_activation_quant(quant) if quant else bank
    ids, weights = make_routes(5, 8, bank.num_experts, seed=6)
    ids[1:, :3] = ids[0, :3]  # the others share three of token 0's experts, in other places
    ids[1:] = ids[1:].roll(1, dims=1)
    x, weights = x_for(bank, 5).to(dtype), weights.to(dtype)
    alone = fused_cpu_moe(x[:1], ids[:1], weights[:1], bank)
    for tokens in range(2, 6):
        batched = fused_cpu_moe(x[:tokens], ids[:tokens], weights[:tokens], bank)
        assert torch.equal(batched[:1], alone), f"{tokens} tokens"


@pytest.mark.parametrize("fmt", ["q4_k+q8", "q6_k+q8", "q2_k+q8", "q4_0+q8"])
def test_a_prefill_of_tokens_on_the_same_experts_gives_each_its_own_bits(fmt: str) -> None:
    """21 tokens routed to the same 8 experts (in other places): a k-quant's rows are dotted
    by tiles of up to 8 tokens (numba_moe_q8.WIDE, on AVX-512 targets) and the rest by tiles
    of up to 4, q4_0's by 2 x 4: every token's output is, bit for bit, its own call's alone
    (a one-token tile), and all of them the reference's sums."""
    name, _, quant = fmt.partition("+")
    bank = make_bank(name, experts=16, hidden=160, inter=64, seed=5).with_activation_quant(quant)
    tokens = 21
    ids, weights = make_routes(tokens, 8, bank.num_experts, seed=8)
    ids[:] = ids[0]
    ids[1::2] = ids[1::2].roll(3, dims=1)
    x = x_for(bank, tokens)
    batched = fused_cpu_moe(x, ids, weights, bank)
    for t in range(tokens):
        alone = fused_cpu_moe(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], bank)
        assert torch.equal(batched[t : t + 1], alone), f"token {t}"
    torch.testing.assert_close(batched, bank_moe(x, ids, weights, bank), **FP32_TOL)
