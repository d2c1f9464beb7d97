"""The CPU decode-attention kernel (kernels/numba_attention.py, through KVCache.fused_attention
and layers/attention.attend) against its reference, the torch path (KVCache.update, then
torch's SDPA) of a cache built with attention_kernel="off": the same steps on both, each row
starting out with another occupant's keys; grouped-query ratios (tiles of 4, 2 and 1 heads),
head sizes (whole vectors, a tail, only a tail), sliding windows kept as rings and not, rows at
different positions and out of order, rows past the window and past the kernel's softmax
block. The caches must be equal bit for bit after every step; the outputs within the
contract's tolerance (assert_matches), and in bfloat16 SDPA's bits on a machine whose SDPA the
kernel reproduces (numba_attention.gives_sdpa_bits: torch's exp and lanes, MKL's GEMM order),
which this module's checks then hold it to. A kernel that drops a key fails the comparison;
every instruction path of the machine passes it (decode_attention_check.py in a process of its
own)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hybridmoe.models  # noqa: F401  (registers the families)
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.kernels import numba_attention
from hybridmoe.kernels.attention_ir import ORDERS
from hybridmoe.layers.attention import attend, sdpa
from hybridmoe.layers.batch import ForwardBatch, build_attention_masks
from hybridmoe.models.registry import family_for

ROWS = 3
DTYPES = [torch.float32, torch.bfloat16]


def config(heads: int, kv_heads: int, head_dim: int, window: int):
    raw = {
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": 16,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "vocab_size": 10,
        "sliding_window": window,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    return family_for(raw).config_from(raw)


def make_batch(
    cfg, cache: KVCache, positions: torch.Tensor, rows: list[int], decode: bool | None = None
) -> ForwardBatch:
    """What MoeCausalLM.make_batch computes, without the rotary (`decode` None: one token
    per row)."""
    kv_len = int(positions.max()) + 1
    starts = tuple(positions[:, 0].tolist())
    windows = {cfg.layer_window(i) for i in range(cfg.num_layers)}
    masks = build_attention_masks(positions, kv_len, windows, cache.ring_windows, starts)
    empty = torch.zeros(*positions.shape, 0)
    decode = positions.shape[1] == 1 if decode is None else decode
    return ForwardBatch(
        positions, rows, torch.tensor(rows), kv_len, masks, empty, empty, cache, decode, starts
    )


def assert_matches(got: torch.Tensor, expected: torch.Tensor, v_max: float) -> float:
    """The contract's tolerance; returns the fraction of elements equal bit for bit. In
    bfloat16 an element may differ by one ulp of the output (its rounding) plus 2^-8 v_max:
    the weights are rounded to bfloat16, and a weight p whose float32 value differs in its
    last bits (torch sums its dot products in another order) may round one ulp (<= 2^-8 p)
    the other way, which moves the output by at most 2^-8 max |v| over all of them."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:  # one bfloat16 ulp of the reference: 2^(exponent - 7)
        exact = expected.float()
        ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2.0**-126))) - 7)
        excess = (got.float() - exact).abs() - ulp - 2.0**-8 * v_max
        assert excess.max() <= 0, f"off by {excess.max()} more than the tolerance"
    return (got == expected).float().mean().item()


class Pair:
    """A cache attending through the kernel and its reference, fed the same steps."""

    def __init__(self, cfg, max_len: int, dtype: torch.dtype, ring: bool):
        self.cfg, self.dtype, self.gen = cfg, dtype, torch.Generator().manual_seed(0)
        self.fast = KVCache(cfg, ROWS, max_len, dtype, ring=ring, attention_kernel="on")
        self.slow = KVCache(cfg, ROWS, max_len, dtype, ring=ring, attention_kernel="off")
        for fast, slow in zip(self.fast.k + self.fast.v, self.slow.k + self.slow.v, strict=True):
            fast.copy_(torch.randn(fast.shape, generator=self.gen) * 3)  # an old occupant's
            slow.copy_(fast)
        self.equal: list[float] = []

    def step(self, positions: list[list[int]], rows: list[int], decode=None, **kwargs) -> None:
        """One step of the rows `rows` at `positions` through both caches, every layer. The
        reference of a decode step of several rows is SDPA over each sequence's keys alone (its
        rows one by one, as each sequence decodes alone): the kernel gives that in a batch."""
        cfg, positions_t = self.cfg, torch.tensor(positions)
        B, T = positions_t.shape
        alone = T == 1 and B > 1 and decode is not False
        for layer in range(cfg.num_layers):
            shapes = [(B, T, cfg.num_heads, cfg.head_dim)]
            shapes += [(B, T, cfg.num_kv_heads, cfg.head_dim)] * 2
            qkv = [(torch.randn(s, generator=self.gen).to(self.dtype) * 2) for s in shapes]
            step = (qkv, positions_t, rows, layer, decode, kwargs)
            fast = self._attend(self.fast, list(range(B)), step)
            if alone:
                slow = torch.cat([self._attend(self.slow, [b], step) for b in range(B)])
            else:
                slow = self._attend(self.slow, list(range(B)), step)
            v_max = self.slow.v[layer].abs().max().item()  # over every value a query may see
            self.equal.append(assert_matches(fast, slow, v_max))
            assert torch.equal(self.fast.k[layer], self.slow.k[layer])
            assert torch.equal(self.fast.v[layer], self.slow.v[layer])

    def _attend(self, cache: KVCache, picks: list[int], step: tuple) -> torch.Tensor:
        """attend() of the step's rows `picks` as one batch through `cache`."""
        (q, k, v), positions, rows, layer, decode, kwargs = step
        batch = make_batch(self.cfg, cache, positions[picks], [rows[i] for i in picks], decode)
        window = self.cfg.layer_window(layer)
        return attend(q[picks], k[picks], v[picks], batch, layer, window, rotated=True, **kwargs)


def decode_steps(pair: Pair, window: int) -> int:
    """A prefill, a resumed chunk, then decode steps of three rows at different positions,
    each past 3 windows, and rows out of order; returns the decode steps."""
    pair.step([list(range(10))], [2])  # a prefill longer than the window: SDPA
    pair.step([list(range(2))], [0])  # shorter
    pair.step([list(range(2, 5))], [0])  # a resumed chunk
    positions = [5, 10, 0]
    for _ in range(3 * window + 2):
        pair.step([[p] for p in positions], [0, 2, 1])
        positions = [p + 1 for p in positions]
    pair.step([[positions[1]], [positions[0]]], [2, 0])  # rows out of order
    pair.step([[positions[2]]], [1])  # one row alone
    return 3 * window + 4


SHAPES = [(4, 2, 8), (6, 6, 16), (8, 1, 32), (12, 4, 20), (16, 4, 64), (16, 4, 128), (10, 2, 48)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ring", [True, False])
@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_decode_steps_match_sdpa(
    attention_kernel_calls, dtype, ring, heads, kv_heads, head_dim
) -> None:
    window = 4
    pair = Pair(config(heads, kv_heads, head_dim, window), 40, dtype, ring)
    steps = decode_steps(pair, window)
    assert len(attention_kernel_calls) == 2 * steps  # both layers of every decode step
    if dtype == torch.bfloat16:
        assert sum(pair.equal) / len(pair.equal) >= 0.95
        if numba_attention.gives_sdpa_bits(heads, kv_heads, head_dim):
            assert min(pair.equal) == 1.0  # every step's every element: SDPA's bits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ring", [True, False])
def test_long_rows_past_the_softmax_block(attention_kernel_calls, dtype, ring) -> None:
    """Rows over more than one BLOCK of keys, a window longer than a block (kept as a ring
    and not)."""
    block = numba_attention.BLOCK
    window = block + 88
    pair = Pair(config(16, 4, 64, window), 2 * block + 40, dtype, ring)
    pair.step([list(range(2 * block)), list(range(2 * block))], [1, 2])
    pair.step([list(range(block - 3))], [0])
    positions = [block - 3, 2 * block, 2 * block]
    for _ in range(5):  # row 0 across a block's end, rows 1, 2 past the window
        pair.step([[p] for p in positions], [0, 1, 2])
        positions = [p + 1 for p in positions]
    assert attention_kernel_calls == [3] * 2 * 5
    if dtype == torch.bfloat16:
        assert sum(pair.equal) / len(pair.equal) >= 0.95
        if numba_attention.gives_sdpa_bits(16, 4, 64):
            assert min(pair.equal) == 1.0


def test_a_step_the_kernel_does_not_take_goes_to_sdpa(attention_kernel_calls) -> None:
    """Not a decode step (a prefill, however short: its bits must not depend on how many of
    the prompt's tokens a prefix-cache hit left), not a kernel dtype, an attention that is not
    sdpa itself (gpt-oss's sinks: another AttendFn), a cache without the kernel: SDPA."""
    pair = Pair(config(4, 2, 8, 4), 40, torch.float16, True)  # float16: not a kernel dtype
    pair.step([list(range(3))], [0])
    pair.step([[3]], [0])
    pair = Pair(config(4, 2, 8, 4), 40, torch.float32, True)
    pair.step([list(range(3))], [0])  # a prefill
    pair.step([[3]], [0], decode=False)  # a prefill of one token (the rest was cached)
    pair.step([[4]], [0], attend_fn=lambda *args: sdpa(*args))  # as SinkAttention's call
    assert attention_kernel_calls == []
    pair.step([[5]], [0])
    assert attention_kernel_calls == [1, 1]
    pair.fast.attention_kernel = "off"
    pair.step([[6]], [0])
    assert attention_kernel_calls == [1, 1]


def test_sink_attention_stays_on_torch() -> None:
    from hybridmoe.layers.attention import GroupedQueryAttention, SinkAttention

    assert GroupedQueryAttention._attend is sdpa and SinkAttention._attend is not sdpa


def kernel_args(B=2, heads=8, kv_heads=2, D=32, slots=300, dtype=torch.bfloat16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn(4, kv_heads, slots, D, generator=gen).to(dtype) for _ in "kv"]
    q = torch.randn(B, 1, heads, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, 1, kv_heads, D, generator=gen).to(dtype) for _ in "kv")
    return caches, q, k, v


def test_kernel_checks_its_arguments() -> None:
    caches, q, k, v = kernel_args(dtype=torch.float32)
    host = tuple(numba_attention.cache_array(c) for c in caches)
    rows, positions = np.array([0, 1]), np.array([3, 4])
    call = numba_attention.decode_attention
    with pytest.raises(ValueError, match="one query per sequence"):
        call(q.expand(2, 2, 8, 32), k, v, host, 300, rows, positions, 5, None, None)
    with pytest.raises(ValueError, match="do not fit a cache"):
        call(q[:, :, :7], k, v, host, 300, rows, positions, 5, None, None)
    with pytest.raises(TypeError, match="share a dtype"):
        call(q, k.double(), v, host, 300, rows, positions, 5, None, None)
    with pytest.raises(TypeError, match="the caches must hold"):
        call(q.bfloat16(), k.bfloat16(), v.bfloat16(), host, 300, rows, positions, 5, None, None)
    with pytest.raises(ValueError, match="rows need 2 positions"):
        call(q, k, v, host, 300, rows, positions[:1], 5, None, None)
    with pytest.raises(ValueError, match="beyond the cache"):
        call(q, k, v, host, 300, rows, np.array([3, 300]), 301, None, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_parallel_kernel_gives_the_serial_bits(dtype) -> None:
    """numba's pool (threads=2) against the calling thread alone: the same items, the same
    bits, in the output and the cache; q, k, v as rows apart (a split of one projection)."""
    caches, q, k, v = kernel_args(B=3, dtype=dtype)
    stacked = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)  # [B, 1, 384]
    q, k, v = (t.view(3, 1, -1, 32) for t in stacked.split([256, 64, 64], dim=-1))
    assert not q.is_contiguous() and numba_attention.row_stride(q) == 384
    rows, positions = np.array([3, 0, 1]), np.array([7, 250, 99])
    results = []
    for threads in (1, 2):
        copies = [c.clone() for c in caches]
        host = tuple(numba_attention.cache_array(c) for c in copies)
        out = numba_attention.decode_attention(
            q, k, v, host, 300, rows, positions, 251, None, 64, threads=threads
        )
        results.append((out, *copies))
    assert all(map(torch.equal, *results))
    contiguous = [t.contiguous() for t in (q, k, v)]
    copies = [c.clone() for c in caches]
    host = tuple(numba_attention.cache_array(c) for c in copies)
    out = numba_attention.decode_attention(*contiguous, host, 300, rows, positions, 251, None, 64)
    assert torch.equal(out, results[0][0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_kernel_dropping_a_key_fails_the_comparison(dtype) -> None:
    """The comparison can fail: the kernel over all but a row's oldest key (a window one
    short) against SDPA over all of them is outside the tolerance."""
    caches, q, k, v = kernel_args(B=1, dtype=dtype, seed=3)
    caches = [c * 4 for c in caches]  # a key whose weight matters beyond the tolerance
    rows, positions = np.array([2]), np.array([40])
    host = tuple(numba_attention.cache_array(c) for c in caches)
    ks, vs = caches[0][2:3, :, :41].clone(), caches[1][2:3, :, :41].clone()
    ks[:, :, 40], vs[:, :, 40] = k[:, 0], v[:, 0]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), ks, vs, enable_gqa=True
    ).transpose(1, 2)
    v_max = vs.abs().max().item()
    whole = numba_attention.decode_attention(q, k, v, host, 300, rows, positions, 41, None, None)
    assert_matches(whole, expected, v_max)
    short = numba_attention.decode_attention(q, k, v, host, 300, rows, positions, 41, None, 40)
    with pytest.raises(AssertionError):
        assert_matches(short, expected, v_max)


def test_the_bits_check_can_fail(monkeypatch) -> None:
    """gives_sdpa_bits compares the kernel's output with SDPA's bit for bit: a kernel whose
    output is one bfloat16 step off in one element fails it where the kernel passes it; so
    does the kernel in the other GEMM order than the machine's (kernel_order)."""
    numba_attention.gives_sdpa_bits.cache_clear()
    try:
        if not numba_attention.gives_sdpa_bits(8, 2, 64):
            pytest.skip("the kernel does not reproduce this machine's SDPA")
        order = numba_attention.kernel_order()
        assert not numba_attention._tells_order(1 - order)
        numba_attention.gives_sdpa_bits.cache_clear()
        real = numba_attention._attend

        def one_step_off(*args, **kwargs):
            out = real(*args, **kwargs)
            bits = out.view(torch.int16).reshape(-1)
            bits[7] += 1
            return out

        monkeypatch.setattr(numba_attention, "_attend", one_step_off)
        assert not numba_attention.gives_sdpa_bits(8, 2, 64)
    finally:
        numba_attention.gives_sdpa_bits.cache_clear()


REFERENCE_CASES = [  # B, heads, kv_heads, D, positions, slots, window, ring
    (1, 16, 4, 64, [600], 700, None, None),  # two blocks, a tail
    (2, 8, 2, 20, [1100, 37], 1200, None, None),  # a batch's short row: SDPA's blocks are 512
    (3, 4, 4, 8, [5, 530, 17], 600, 100, None),  # a window across a block's end
    (2, 6, 2, 48, [40, 300], 64, None, 64),  # a ring, one row past it
    (1, 8, 2, 32, [129], 140, None, None),  # 130 keys: two loose ones after the groups of four
    (2, 8, 2, 64, [126, 558], 600, None, None),  # 127 (3 loose), 559: a block of 47
    (1, 4, 2, 272, [130], 140, None, None),  # PAIRS: q split at every key (> SPLIT_DIMS), a tail
]


def reference_mismatches(dtype, case, lanes=None, seed=0, order=None, reference_order=None) -> int:
    """Elements of the kernel's output that are not attention_reference's (lanes: the
    reference's, default the kernel's), over every row and head of a random step; the kernel
    in `order` (None: the machine's, kernel_order), the reference in `reference_order` (None:
    the kernel's)."""
    B, heads, kv_heads, D, positions, slots, window, ring = case
    gen = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(B, kv_heads, slots, D, generator=gen) * 2).to(dtype) for _ in "kv"]
    q = (torch.randn(B, 1, heads, D, generator=gen) * 2).to(dtype)
    k, v = ((torch.randn(B, 1, kv_heads, D, generator=gen) * 2).to(dtype) for _ in "kv")
    host = tuple(numba_attention.cache_array(c) for c in caches)
    kv_len, at = max(positions) + 1, np.array(positions)
    order = numba_attention.kernel_order() if order is None else order
    reference_order = order if reference_order is None else reference_order
    out = numba_attention.decode_attention(
        q, k, v, host, slots, np.arange(B), at, kv_len, ring, window, threads=1, order=order
    )
    lanes = lanes or numba_attention.softmax_lanes()
    bad = 0
    for b, p in enumerate(positions):
        keys = min(p + 1, ring) if ring else p + 1  # SDPA's row for this sequence alone
        visible = np.zeros(keys, bool)
        if ring:
            visible[: min(p + 1, ring)] = True
        else:
            visible[max(0, p - window + 1) if window else 0 : p + 1] = True
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            rows = [c[b, kvh, :keys].float().numpy() for c in caches]
            expected = attention_reference_row(q[b, 0, h], rows, visible, D, lanes, reference_order)
            bad += int((expected.to(dtype) != out[b, 0, h]).sum())
    return bad


def attention_reference_row(q, rows, visible, D, lanes, order) -> torch.Tensor:
    from hybridmoe.kernels.attention_reference import attend_row

    scale = np.float32(1.0 / math.sqrt(D))
    bf16 = q.dtype == torch.bfloat16
    out, _, _ = attend_row(q.float().numpy(), *rows, visible, scale, lanes, bf16, order)
    return torch.from_numpy(out)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_the_kernel_gives_the_references_bits(dtype, case, order) -> None:
    """On every machine, in both dtypes and both GEMM orders: the kernel's output is
    attention_reference's (the scalar restatement of torch's flash attention with the stated
    GEMM orders) bit for bit; with the other softmax lanes than the kernel's (another vector
    part and tail, another sum), or the reference in the other order, it is not, seen in
    float32's outputs (in bfloat16 such last bits mostly round away)."""
    assert reference_mismatches(dtype, case, order=order) == 0
    if dtype == torch.float32:
        other_lanes = 24 - numba_attention.softmax_lanes()
        assert reference_mismatches(dtype, case, lanes=other_lanes, order=order) > 0
        assert reference_mismatches(dtype, case, order=order, reference_order=1 - order) > 0


CHECK = Path(__file__).with_name("decode_attention_check.py")


def _paths() -> dict[str, tuple[str | None, str]]:
    """path -> (NUMBA_CPU_FEATURES or None: the host's, what the host needs for the path)."""
    from numba.core.codegen import get_host_cpu_features

    host = get_host_cpu_features().split(",")

    def without(prefixes: tuple[str, ...]) -> str:
        return ",".join("-" + f[1:] if f[1:].startswith(prefixes) else f for f in host)

    above_avx = ("avx2", "avx512", "amx", "avxvnni", "avx10", "avxifma", "avxneconvert")
    above_avx += ("vpclmulqdq", "vaes", "gfni", "fma")
    return {
        "host": (None, ""),
        "avx2": (without(("avx512", "amx", "avx10")), "+avx512f"),
        "portable": (without(above_avx), "+avx2"),
    }


@pytest.mark.parametrize("path", ["host", "avx2", "portable"])
def test_every_instruction_path_matches_sdpa(path: str) -> None:
    """16 lanes (AVX-512), 8 with FMA (AVX2), 8 without (AVX): decode steps within the
    contract, and SDPA's bits in bfloat16 where the machine's SDPA is reproduced (the same
    arithmetic on every path), each path compiled in a process of its own."""
    from numba.core.codegen import get_host_cpu_features

    features, needs = _paths()[path]
    if needs and needs not in get_host_cpu_features().split(","):
        pytest.skip(f"this machine has no other path than the host's here ({needs[1:]} lacking)")
    env = {**os.environ, **({"NUMBA_CPU_FEATURES": features} if features else {})}
    tests = str(Path(__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    expected_lanes = {"host": info["lanes"], "avx2": 8, "portable": 8}[path]
    assert info["lanes"] == expected_lanes and info["steps"] > 0
    assert info["fma"] == (path != "portable")
    assert info["exact"] or not info["sdpa_bits"]
    assert info["reference_mismatches"] == 0


def test_the_bits_sweep_counts_what_differs(monkeypatch, capsys) -> None:
    """scripts/attention_bits_sweep.py: 0 (none differs) where the kernel reproduces SDPA, 1
    with each step's output one bfloat16 step off in one element, naming the steps."""
    import importlib.util

    path = Path(__file__).parents[2] / "scripts" / "attention_bits_sweep.py"
    spec = importlib.util.spec_from_file_location("attention_bits_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    if numba_attention.gives_sdpa_bits(8, 2, 64):
        assert sweep.main(["--seconds", "1", "--max-keys", "600"]) == 0
    real = numba_attention.decode_attention

    def one_step_off(*args, **kwargs):
        out = real(*args, **kwargs)
        out.view(torch.int16).reshape(-1)[0] += 1
        return out

    monkeypatch.setattr(numba_attention, "decode_attention", one_step_off)
    assert sweep.main(["--seconds", "0.5", "--max-keys", "600"]) == 1
    assert "differs: {'heads'" in capsys.readouterr().out
