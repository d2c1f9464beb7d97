"""The q8 activation contract (quant/activation_q8.py): its torch reference against a plain loop and
ggml's Q8_0 bytes, the numba quantiser against it to the bit, and every path that computes a layer
with it (the numba layer kernel, the accelerator's gathered_moe) against bank_moe. A projection is
the contract's to the bit on every path (the tile, on every instruction path:
tests/kernel_tests/test_activation_q8_paths.py); a layer differs from bank_moe where the float
path's does (the order of the sum over routes; silu's bits are torch's where torch's silu is
vectorised: kernels/activation_ir.py), and where such an ulp moves an activation across a rounding
boundary of its quantisation, by one q8 step (layer_flips), far below q8's own effect
(test_q8_changes_the_arithmetic_not_the_model). The k-quants with integer super-blocks (q2_k ...
q6_k) likewise, their integers also against gguf's dequantisation. Numba layer kernels compiled:
q4_0 gate/up beside q8_0 down, q4_k beside q6_k, q5_k beside q8_0, q2_k beside q3_k (a Q2_K file's
pair)."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from hybridmoe.kernels.numba_moe_q8 import SHORT_ROW_WEIGHTS
from hybridmoe.kernels.torch_moe import gathered_moe
from hybridmoe.moe.cpu_experts import FUSED_MAX_TOKENS, bank_moe, fused_cpu_moe
from hybridmoe.quant.activation_q8 import (
    LANES,
    q8_bmm,
    q8_linear,
    quantize_activations,
    resolve,
)
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import weight_format
from hybridmoe.quant.random_blocks import random_stored

Q4_0, Q8_0 = weight_format("q4_0"), weight_format("q8_0")
# 11 blocks a gate/up row (one group of 8 and a tail of 3), 9 a down row (a group and one)
HIDDEN, INTER, EXPERTS = 352, 288, 6


def layer_flips(actual: torch.Tensor, expected: torch.Tensor, case: str) -> bool:
    """Whether `actual` is off `expected` by more than the float path's own differences
    (~2e-7 of the largest output): where an activation 1 ulp apart rounded to the next
    integer, which moves that route's outputs by ~1e-4 of the largest; AssertionError beyond
    1e-3 of it (q8's own effect is ~1e-2)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-3 * scale, msg=case)
    return bool(((actual - expected).abs() > 2e-6 * scale + 1e-5 * expected.abs()).any())


def _loop_reference(x: np.ndarray, stored: torch.Tensor, fmt) -> np.float32:
    """One output of the contract, written out as its docstring says, in numpy float32."""
    qx, dx = (t.numpy() for t in quantize_activations(torch.from_numpy(x)[None]))
    qw, dw = (t.numpy() for t in fmt.int8_blocks(stored[None]))
    lanes = [np.float32(0.0)] * LANES
    for b in range(qx.shape[1]):
        s = np.float32(int((qx[0, b].astype(np.int64) * qw[0, b].astype(np.int64)).sum()))
        lanes[b % LANES] = np.float32(lanes[b % LANES] + s * np.float32(dw[0, b] * dx[0, b]))
    halves = lanes
    while len(halves) > 1:
        half = len(halves) // 2
        halves = [np.float32(a + b) for a, b in zip(halves[:half], halves[half:], strict=True)]
    return halves[0]


@pytest.mark.parametrize("fmt", [Q8_0, Q4_0], ids=lambda f: f.name)
@pytest.mark.parametrize("blocks", [1, 8, 11, 17])
def test_reference_is_the_stated_order(fmt, blocks: int) -> None:
    gen = torch.Generator().manual_seed(blocks)
    x = torch.randn(3, 32 * blocks, generator=gen)
    stored = fmt.quantize(torch.randn(5, 32 * blocks, generator=gen))
    out = q8_linear(x, stored, fmt)  # [3, 5]
    for t in range(3):
        for r in range(5):
            assert out[t, r].item() == _loop_reference(x[t].numpy(), stored[r], fmt), (t, r)
    batched = q8_bmm(x, stored[None].expand(3, -1, -1), fmt)
    assert torch.equal(batched, out)


def test_quantiser_is_ggml_q8_0() -> None:
    """The activations' int8 and scales are Q8_0's bytes before the scale is stored as fp16;
    a tie x / d = n + 1/2 rounds away from zero."""
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    x[0, :2] = torch.tensor([127.0, 0.5])  # d = 1: 0.5 rounds to 1
    x[1, :2] = torch.tensor([-127.0, -2.5])  # -2.5 rounds to -3
    q, d = quantize_activations(x)
    blocks = Q8_0.quantize(x).view(7, 2, 34)
    assert torch.equal(q, blocks[..., 2:].view(torch.int8))
    assert torch.equal(d.half(), blocks[..., :2].contiguous().view(torch.float16)[..., 0])
    assert q[0, 0, 1] == 1 and q[1, 0, 1] == -3


def test_numba_quantiser_inside_a_fastmath_caller() -> None:
    """numba's callee inherits its caller's fast-math unless it sets its own: the layer
    kernel's caller has arcp (a reciprocal for a division), the quantiser must not."""
    from hybridmoe.kernels.numba_moe_q8 import quantize_rows

    @numba.njit(fastmath={"contract", "arcp"})
    def caller(x, n, q, d):
        quantize_rows(x, n, q, d)

    x = torch.randn(40 * 32, generator=torch.Generator().manual_seed(2)) * 3
    q, d = np.empty(x.numel(), np.int8), np.empty(40, np.float32)
    caller(x.numpy(), x.numel(), q, d)
    ref_q, ref_d = quantize_activations(x)
    assert np.array_equal(q, ref_q.reshape(-1).numpy())
    assert np.array_equal(d, ref_d.numpy())


@pytest.mark.parametrize("block", [32, 256])
def test_vector_quantiser_gives_the_scalar_references_bits(block: int) -> None:
    """quantize_rows (vectors: numba_simd_q8.quantize_block) against quantize_rows_reference
    (one value at a time) on blocks of every scale, an all-zero block and blocks of exact
    ties (x * (1 / d) at k + 0.5, which roundf takes away from zero)."""
    from hybridmoe.kernels.numba_moe_q8 import quantize_rows, quantize_rows_reference

    rng = np.random.default_rng(block)
    blocks = [rng.standard_normal(block) * 10.0 ** rng.uniform(-30, 4) for _ in range(60)]
    blocks.append(np.zeros(block))
    ties = rng.integers(-254, 255, block) / 2.0  # max |x| 127: d = 1, every half a tie
    ties[:3] = (127.0, 2.5, -2.5)
    blocks.append(ties)
    x = np.concatenate(blocks).astype(np.float32)
    n = x.size
    got = np.empty(n, np.int8), np.empty(n // block, np.float32)
    want = np.empty(n, np.int8), np.empty(n // block, np.float32)
    quantize_rows(x, n, *got, block)
    quantize_rows_reference(x, n, *want, block)
    assert np.array_equal(got[0], want[0])
    assert np.array_equal(got[1].view(np.uint32), want[1].view(np.uint32))
    tie = (len(blocks) - 1) * block
    assert list(got[0][tie : tie + 3]) == [127, 3, -3]  # halves away from zero
    assert not got[0][tie - block : tie].any() and got[1][-2] == 0  # the zero block


def _bank(stacked: bool) -> ExpertBank:
    gen = torch.Generator().manual_seed(3)
    gate_up = Q4_0.quantize(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen))
    down = Q8_0.quantize(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / 8)
    if stacked:
        return ExpertBank(gate_up, down, Q4_0, down_fmt=Q8_0, activation_quant="q8")
    gate, up = gate_up[:, :INTER].contiguous(), gate_up[:, INTER:].contiguous()
    return ExpertBank(gate=gate, up=up, down=down, fmt=Q4_0, down_fmt=Q8_0, activation_quant="q8")


def _routes(tokens: int, top_k: int, seed: int, hidden: int = HIDDEN):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.randint(0, EXPERTS, (tokens, top_k), generator=gen)
    ids[torch.rand(tokens, top_k, generator=gen) < 0.2] = -1  # skipped routes
    return x, ids, torch.rand(tokens, top_k, generator=gen)


def test_every_path_computes_the_reference() -> None:
    """T = 1..16 (the fused kernel) and beyond (bank_moe itself), K = 1, 3, 8, skipped routes;
    gathered_moe at K = 8; a bank holding gate and up apart at a few of them."""
    stacked, separate = _bank(stacked=True), _bank(stacked=False)
    flips, cases = 0, 0
    for top_k in (1, 3, 8):
        for tokens in [*range(1, FUSED_MAX_TOKENS + 1), FUSED_MAX_TOKENS + 3]:
            x, ids, weights = _routes(tokens, top_k, 100 * top_k + tokens)
            expected = bank_moe(x, ids, weights, stacked)
            case = f"K={top_k} T={tokens}"
            paths = [fused_cpu_moe, gathered_moe] if top_k == 8 else [fused_cpu_moe]
            banks = [stacked, separate] if tokens in (1, 5) else [stacked]
            for path in paths:
                for bank in banks:
                    flips += layer_flips(path(x, ids, weights, bank), expected, case)
                    cases += 1
    assert flips <= cases // 10, f"{flips} of {cases} calls off by a q8 step"


def test_bf16_activations_and_router_weights() -> None:
    bank = _bank(stacked=True)
    for tokens in (1, 5):
        x, ids, weights = _routes(tokens, 4, tokens)
        x, weights = x.bfloat16(), weights.bfloat16()
        expected = bank_moe(x, ids, weights, bank)
        for path in (fused_cpu_moe, gathered_moe):
            actual = path(x, ids, weights, bank)
            torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)  # bf16 steps


def test_q8_changes_the_arithmetic_not_the_model() -> None:
    """With q8 off the same bank computes the float path; the two agree to the activations'
    quantisation error (a test that q8 is really on, and of the right size)."""
    bank = _bank(stacked=True)
    x, ids, weights = _routes(4, 2, 7)
    with_q8 = bank_moe(x, ids, weights, bank)
    without = bank_moe(x, ids, weights, bank.with_activation_quant("none"))
    assert not torch.equal(with_q8, without)
    torch.testing.assert_close(with_q8, without, rtol=0.05, atol=0.05 * without.abs().max())


def test_mixed_kinds_are_refused() -> None:
    q5_1 = weight_format("q5_1")
    down = q5_1.quantize(torch.zeros(1, 256, 256))
    gate_up = Q8_0.quantize(torch.zeros(1, 512, 256))
    with pytest.raises(ValueError, match="mix formats with integer dot products"):
        ExpertBank(gate_up, down, Q8_0, down_fmt=q5_1, activation_quant="q8")
    with pytest.raises(ValueError, match="activation_quant must be one of"):
        ExpertBank(gate_up, Q8_0.quantize(torch.zeros(1, 256, 256)), Q8_0, activation_quant="q4")
    with pytest.raises(ValueError, match="activation_quant must be one of none, q8"):
        ExpertBank(gate_up, down, Q8_0, down_fmt=q5_1, activation_quant="auto")  # resolved first


@pytest.mark.parametrize(
    ("names", "chosen"),
    [(("q8_0", "q8_0"), "q8"), (("q4_0", "q8_0"), "q8"), (("q4_k", "q6_k"), "q8"),
     (("q5_k", "q8_0"), "q8"), (("q2_k", "q3_k"), "q8"), (("q8_0", "q5_1"), "none"),
     (("q4_1", "q4_1"), "none"), (("mxfp4", "mxfp4"), "none"), (("bf16", "bf16"), "none"),
     (("f32", "f32"), "none")],
)  # fmt: skip
def test_auto_takes_q8_where_every_format_has_integer_dots(names, chosen) -> None:
    """OffloadConfig's default, auto: q8 for a layer whose experts all have integer dots (as
    llama.cpp computes them), none for floats, the other quantised formats and a mix; an
    explicit choice stays."""
    formats = tuple(weight_format(n) for n in names)
    assert resolve("auto", formats) == chosen
    assert resolve("none", formats) == "none" and resolve("q8", formats) == "q8"


# k-quants with integer super-blocks (q2_k ... q6_k): 3 super-blocks a gate/up row, 1 a
# down row; Q4_K_M's pair (q4_k gate/up, q6_k down) and q5_k beside q8_0 (32- and 256-blocks)
K_HIDDEN, K_INTER = 768, 256
SUPER_BLOCK_FORMATS = [weight_format(n) for n in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")]


@pytest.mark.parametrize("fmt", SUPER_BLOCK_FORMATS, ids=lambda f: f.name)
def test_superblock_ints_are_the_dequantised_weights(fmt) -> None:
    """The integer view against gguf's numpy dequantisation (an independent reader of the
    bytes): per super-block, d S - dmin M (float64, exact) is Σ w_i q_i of gguf's weights,
    so the integers and the formula of the contract's steps 2-3 are those weights'."""
    from gguf import GGMLQuantizationType, quants

    gen = torch.Generator().manual_seed(11)
    stored = random_stored(fmt, (3, 512), gen)
    w = quants.dequantize(stored.numpy(), GGMLQuantizationType[fmt.name.upper()])
    w = torch.from_numpy(w).double().reshape(3, 2, 256)
    q, _ = quantize_activations(torch.randn(1, 512, generator=gen), 256)  # [1, 2, 256]
    ints = fmt.superblock_ints(stored)  # [3, 2, ...]
    subs = ints.scales.shape[-1]
    u = ints.u.double().reshape(3, 2, subs, -1) - ints.offset
    qg = q[0].double().reshape(2, subs, -1)
    s = ((u * qg).sum(-1) * ints.scales.double()).sum(-1)  # [3, 2]
    total = s * ints.d.double()
    if ints.mins is not None:
        total -= (qg.sum(-1) * ints.mins.double()).sum(-1) * ints.dmin.double()
    assert torch.equal(total, (w * q[0].double()).sum(-1))


@pytest.mark.parametrize("fmt", SUPER_BLOCK_FORMATS, ids=lambda f: f.name)
def test_superblock_reference_is_the_stated_order(fmt) -> None:
    """q8_linear of a k-quant row against the contract written out in numpy float32."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, 9 * 256, generator=gen)  # 9 super-blocks: lane 0 takes two
    stored = random_stored(fmt, (3, 9 * 256), gen)
    out = q8_linear(x, stored, fmt)
    qx, dx = (t.numpy() for t in quantize_activations(x, 256))
    ints = fmt.superblock_ints(stored)
    u, sc = ints.u.numpy().astype(np.int64), ints.scales.numpy().astype(np.int64)
    for t in range(2):
        for r in range(3):
            lanes = [np.float32(0.0)] * LANES
            for b in range(9):
                qg = qx[t, b].astype(np.int64).reshape(sc.shape[-1], -1)
                ug = u[r, b].reshape(sc.shape[-1], -1) - ints.offset
                s = np.float32(int(((ug * qg).sum(-1) * sc[r, b]).sum()))
                p = s * np.float32(ints.d[r, b].item() * dx[t, b])
                if ints.mins is not None:
                    m = np.float32(int((qg.sum(-1) * ints.mins[r, b].numpy()).sum()))
                    p = np.float32(p - m * np.float32(ints.dmin[r, b].item() * dx[t, b]))
                lanes[b % LANES] = np.float32(lanes[b % LANES] + p)
            while len(lanes) > 1:
                half = len(lanes) // 2
                lanes = [np.float32(a + b) for a, b in zip(lanes[:half], lanes[half:], strict=True)]
            assert out[t, r].item() == lanes[0], (t, r)
    assert torch.equal(q8_bmm(x, stored[None].expand(2, -1, -1), fmt), out)


def _kquant_bank(gate_up_fmt, down_fmt, hidden: int = K_HIDDEN) -> ExpertBank:
    gen = torch.Generator().manual_seed(4)
    gate_up = random_stored(gate_up_fmt, (EXPERTS, 2 * K_INTER, hidden), gen)
    down = random_stored(down_fmt, (EXPERTS, hidden, K_INTER), gen)
    return ExpertBank(gate_up, down, gate_up_fmt, down_fmt=down_fmt, activation_quant="q8")


@pytest.mark.parametrize(
    "formats", [("q4_k", "q6_k"), ("q5_k", "q8_0"), ("q2_k", "q3_k")], ids=lambda f: "+".join(f)
)
def test_kquant_layers_compute_the_reference(formats) -> None:
    """The numba layer kernel and gathered_moe against bank_moe for k-quant banks under q8,
    T = 1..16 and beyond, K = 2 and 8, skipped routes, and with bf16 activations; q8 really
    on (it differs from the float path by the activations' quantisation error)."""
    bank = _kquant_bank(*(weight_format(n) for n in formats))
    assert bank.q8_activations
    flips, cases = 0, 0
    for top_k in (2, 8):
        for tokens in (1, 2, 3, 5, 8, FUSED_MAX_TOKENS, FUSED_MAX_TOKENS + 3):
            x, ids, weights = _routes(tokens, top_k, 10 * top_k + tokens, K_HIDDEN)
            expected = bank_moe(x, ids, weights, bank)
            for path in (fused_cpu_moe, gathered_moe):
                flips += layer_flips(path(x, ids, weights, bank), expected, f"{top_k} {tokens}")
                cases += 1
    for tokens in (1, 5):  # bf16 activations and router weights: bf16's roundings in each step
        x, ids, weights = _routes(tokens, 8, tokens, K_HIDDEN)
        x, weights = x.bfloat16(), weights.bfloat16()
        expected = bank_moe(x, ids, weights, bank)
        for path in (fused_cpu_moe, gathered_moe):
            flips += layer_flips(path(x, ids, weights, bank), expected, f"bf16 {tokens}")
            cases += 1
    assert flips <= cases // 10, f"{flips} of {cases} calls off by a q8 step"
    x, ids, weights = _routes(4, 2, 7, K_HIDDEN)
    with_q8 = bank_moe(x, ids, weights, bank)
    without = bank_moe(x, ids, weights, bank.with_activation_quant("none"))
    assert not torch.equal(with_q8, without)
    torch.testing.assert_close(with_q8, without, rtol=0.05, atol=0.05 * without.abs().max())


@pytest.mark.parametrize("formats", [("q4_k", "q6_k"), ("q2_k", "q3_k")], ids=lambda f: "+".join(f))
def test_kquant_layer_on_long_rows_computes_the_reference(formats) -> None:
    """One token's tiles by row length (numba_moe_q8.matmul_q8): gate/up rows of
    SHORT_ROW_WEIGHTS weights (a Qwen3-30B-A3B gate/up row, 2048) take fmt.one_token_rows-row
    tiles, the 256-weight down rows fmt.short_row_rows-row ones (q3_k: 4 rows against q2_k's
    1 on the long rows), the numba layer against bank_moe as above; the other tests' rows are
    all short."""
    gate_up_fmt, down_fmt = (weight_format(n) for n in formats)
    bank = _kquant_bank(gate_up_fmt, down_fmt, hidden=SHORT_ROW_WEIGHTS)
    assert K_INTER < SHORT_ROW_WEIGHTS
    flips, cases = 0, 0
    for tokens, top_k in ((1, 8), (1, 2), (2, 8)):
        x, ids, weights = _routes(tokens, top_k, 3 * tokens + top_k, SHORT_ROW_WEIGHTS)
        for dtype in (torch.float32, torch.bfloat16):  # bf16: activations and router weights
            xd, wd = x.to(dtype), weights.to(dtype)
            expected = bank_moe(xd, ids, wd, bank)
            flips += layer_flips(fused_cpu_moe(xd, ids, wd, bank), expected, f"{tokens} {dtype}")
            cases += 1
    assert flips <= cases // 3, f"{flips} of {cases} calls off by a q8 step"
