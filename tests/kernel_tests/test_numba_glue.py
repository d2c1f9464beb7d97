"""kernels/numba_glue.py (through kernels/glue.py) against torch, the references in
layers/norm.py, moe/routing.py and layers/moe.py, and against a scalar Python restatement of
its sum order: the same bits, measured on every row (not most of them)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybridmoe import env
from hybridmoe.kernels import glue, numba_glue
from hybridmoe.layers import norm
from hybridmoe.moe import routing

LANES, ILP, LEVELS = numba_glue.LANES, numba_glue.ILP, numba_glue.LEVELS


def _row_sum_reference(elements: list[np.ndarray]) -> np.ndarray:
    """SumKernel.cpp row_sum restated: the (-1, 4) view's cascade (multi_row_sum), the leftover
    elements into partial 0, partials 1..3 into partial 0; elements are float32 arrays."""
    rows = len(elements) // ILP
    power = max(4, (math.ceil(math.log2(rows)) if rows > 1 else 0) // LEVELS)
    step = 1 << power
    zero = np.zeros_like(elements[0]) if elements else np.zeros(1, np.float32)
    acc = [[zero.copy() for _ in range(ILP)] for _ in range(LEVELS)]
    i = 0
    while i + step <= rows:
        for _ in range(step):
            for k in range(ILP):
                acc[0][k] = acc[0][k] + elements[i * ILP + k]
            i += 1
        for level in range(1, LEVELS):
            for k in range(ILP):
                acc[level][k] = acc[level][k] + acc[level - 1][k]
                acc[level - 1][k] = zero.copy()
            if i & ((step - 1) << (level * power)):
                break
    for row in range(i, rows):
        for k in range(ILP):
            acc[0][k] = acc[0][k] + elements[row * ILP + k]
    for level in range(1, LEVELS):
        for k in range(ILP):
            acc[0][k] = acc[0][k] + acc[level][k]
    for e in range(rows * ILP, len(elements)):
        acc[0][0] = acc[0][0] + elements[e]
    for k in range(1, ILP):
        acc[0][0] = acc[0][0] + acc[0][k]
    return acc[0][0]


def cascade_sum_reference(v: np.ndarray) -> np.float32:
    """torch's CPU sum of a contiguous float32 row, one float32 addition at a time."""
    n = len(v)
    if n < LANES:
        return np.float32(_row_sum_reference([v[i : i + 1] for i in range(n)])[0])
    vectors = n // LANES
    lanes = _row_sum_reference([v[e * LANES : (e + 1) * LANES] for e in range(vectors)])
    total = np.float32(0)
    for x in list(v[vectors * LANES :]) + list(lanes):
        total = np.float32(total + x)
    return total


def _numba_sum(v: np.ndarray) -> np.float32:
    return numba_glue._inner_sum(v, len(v), np.empty(LEVELS * ILP * LANES, np.float32))


@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 31, 64, 100, 128, 257, 2048, 3000, 4096, 32768])
def test_sum_order_is_torchs(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    for _ in range(3):
        v = (torch.randn(n, generator=gen) * 10) ** 2  # squares, as the norm sums
        want = v.sum().item()
        got = _numba_sum(v.numpy())
        assert got == cascade_sum_reference(v.numpy()), (n, got)
        assert got == np.float32(want), (n, got, want)


@pytest.mark.parametrize("rows,n", [(2, 16384), (8, 4096), (16, 2048), (3, 100)])
def test_sum_order_holds_with_torch_threads(rows: int, n: int) -> None:
    """torch's threads share out whole rows (a decode step's [B, H] norm input), not parts of
    one: each row's sum keeps the order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        v = (torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)) * 10) ** 2
        want = v.sum(-1)
    finally:
        torch.set_num_threads(threads)
    for r in range(rows):
        assert _numba_sum(v[r].numpy()) == np.float32(want[r].item()), r


def test_another_order_differs() -> None:
    """The sum test can fail: sequential float32 addition misses torch's sum on some rows."""
    gen = torch.Generator().manual_seed(0)
    misses = 0
    for _ in range(50):
        v = (torch.randn(2048, generator=gen) * 10) ** 2
        sequential = np.float32(0)
        for x in v.numpy():
            sequential = np.float32(sequential + x)
        misses += sequential != np.float32(v.sum().item())
    assert misses > 0


def _norm_reference_row(x: np.ndarray, w: np.ndarray, eps: float, scale_rounded: bool):
    """One row of numba_glue.norm_rows restated in float32 scalars (bfloat16 as float32
    values; the caller rounds the result)."""
    mean = np.float32(cascade_sum_reference(x * x) / np.float32(len(x)))
    inv = np.float32(1) / np.sqrt(np.float32(mean + np.float32(eps)))
    h = (x * inv).astype(np.float32)
    if scale_rounded:
        h = torch.from_numpy(h).bfloat16().float().numpy()
    return (h * w).astype(np.float32)


SHAPES = [(1, 2048), (1, 1, 2048), (3, 1, 128), (1, 32, 128), (16, 2048), (4, 7), (2, 3000)]


def _inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    y = torch.randn(shape, generator=gen).to(dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    return x, y, w


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_equals_torch(shape, dtype) -> None:
    x, y, w = _inputs(shape, dtype, sum(shape))
    assert glue.norm(x, w, 1e-6, dtype == torch.bfloat16) is not None  # the kernel ran
    assert torch.equal(norm.rms_norm(x, w, 1e-6), norm.rms_norm_torch(x, w, 1e-6))
    s, h = norm.add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(s, x + y) and torch.equal(h, norm.rms_norm_torch(x + y, w, 1e-5))
    assert s.dtype == h.dtype == dtype and h.shape == x.shape


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offset_rms_norm_equals_torch(shape, dtype) -> None:
    x, y, w = _inputs(shape, dtype, 7 + sum(shape))
    scale = norm.offset_weight(w - 1)
    assert torch.equal(
        norm.offset_rms_norm(x, scale, 1e-6), norm.offset_rms_norm_torch(x, scale, 1e-6)
    )
    s, h = norm.add_offset_rms_norm(x, y, scale, 1e-6)
    assert torch.equal(s, x + y)
    assert torch.equal(h, norm.offset_rms_norm_torch(x + y, scale, 1e-6))


@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 1, 128), (64, 2048)])  # decode, prefill
@pytest.mark.parametrize("kind", ["rms", "offset_rms"])
def test_add_norm_rounds_a_float32_y_first(shape, kind) -> None:
    """A float32 y (an MoE layer's unrounded partial) is rounded to x's dtype before the add,
    in the kernel (decode-sized) and in torch (prefill-sized): the bits of y.to(x.dtype)."""
    x, _, w = _inputs(shape, torch.bfloat16, 5)
    y = torch.randn(shape, generator=torch.Generator().manual_seed(9)) * 2  # float32
    norm_kind = norm.NORMS[kind]
    kept = norm_kind.prepare(w)
    got = norm_kind.add_apply(x, y, kept, 1e-6)
    want = norm_kind.add_apply(x, y.to(torch.bfloat16), kept, 1e-6)
    assert not torch.equal(y.to(torch.bfloat16).float(), y)  # y's rounding matters here
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_norm_equals_scalar_reference() -> None:
    x, _, w = _inputs((4, 2048), torch.bfloat16, 1)
    got = norm.rms_norm(x, w, 1e-6).float().numpy()
    for r in range(4):
        row = _norm_reference_row(x[r].float().numpy(), w.float().numpy(), 1e-6, True)
        assert np.array_equal(got[r], torch.from_numpy(row).bfloat16().float().numpy())


def test_norm_rounds_like_torch_at_the_edges() -> None:
    """Large values (rounding to inf), tiny ones, zeros and a NaN row."""
    x = torch.tensor([[3e38, -3e38, 1.0, 0.0], [1e-30, 2e-30, 0.0, 0.0], [0.0] * 4])
    x = torch.cat([x, torch.tensor([[float("nan"), 1.0, 2.0, 3.0]])]).bfloat16()
    w = torch.tensor([1.0, 2.0, 3e38, 0.5]).bfloat16()
    want, got = norm.rms_norm_torch(x, w, 1e-6), norm.rms_norm(x, w, 1e-6)
    assert torch.equal(want.isnan(), got.isnan())
    assert torch.equal(want.nan_to_num(), got.nan_to_num())


def test_the_switch_and_the_limits(monkeypatch) -> None:
    """Only decode-sized contiguous host bfloat16/float32 tensors reach the kernels."""
    x, w = torch.randn(1, 2048), torch.ones(2048)
    assert glue.norm(x, w, 1e-6, False) is not None
    assert glue.norm(x.half(), w.half(), 1e-6, False) is None  # float16 stays with torch
    assert glue.norm(torch.randn(64, 2048), w, 1e-6, False) is None  # prefill-sized
    assert glue.norm(torch.randn(4, 16)[:, ::2], w[:8], 1e-6, False) is None  # strided
    assert glue.norm(x, w, 1e-6, False, torch.randn(2048, 2)[:, 0][None]) is None  # a strided y
    assert glue.route_topk(torch.rand(1, 8).half(), 2, True, torch.bfloat16) is None
    monkeypatch.setenv("HYBRIDMOE_GLUE_KERNELS", "0")
    env.reread_switches()
    try:
        assert glue.norm(x, w, 1e-6, False) is None
        assert glue.route_topk(torch.rand(1, 8), 2, True, torch.float32) is None
    finally:
        monkeypatch.delenv("HYBRIDMOE_GLUE_KERNELS")
        env.reread_switches()
    assert glue.norm(x, w, 1e-6, False) is not None


@pytest.mark.parametrize("experts,top_k", [(8, 2), (60, 4), (64, 6), (128, 8), (16, 16)])
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("weights_fp32", [False, True])
def test_route_equals_torch(experts, top_k, renorm, weights_fp32) -> None:
    gen = torch.Generator().manual_seed(experts * top_k)
    fast = 0
    for t in (1, 1, 1, 3):
        logits = (torch.randn(t, experts, generator=gen) * 2).bfloat16()
        want = routing.route_torch(logits, top_k, renorm, weights_fp32)
        got = routing.route(logits, top_k, renorm, weights_fp32)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[1].dtype == want[1].dtype
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        fast += glue.route_topk(probs, top_k, renorm, want[1].dtype) is not None
    assert fast > 0  # the kernel's answer was compared, not only torch's


def test_route_picks_torchs_experts_among_ties() -> None:
    """A tie among the k + 1 largest: torch.topk's experts, in its order (numba_glue.
    _torch_topk); where torch takes the path not reproduced (k * 64 <= experts) a tie at the
    k-th place is left to torch.topk."""
    probs = torch.tensor([[0.1, 0.3, 0.2, 0.3, 0.1]])
    for k in (1, 2, 3, 4):
        ids, weights = glue.route_topk(probs, k, False, torch.float32)
        want = torch.topk(probs, k)
        assert torch.equal(ids, want.indices) and torch.equal(weights, want.values)
    top = torch.tensor([[0.4, 0.3]])
    ids, weights = glue.route_topk(torch.tensor([[0.1, 0.3, 0.2, 0.4]]), 2, True, torch.float32)
    assert ids.tolist() == [[3, 1]] and torch.equal(weights, top / top.sum())
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 1.0]]).bfloat16()
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            routing.route(logits, 2, True), routing.route_torch(logits, 2, True), strict=True
        )
    )
    wide = torch.full((1, 256), 0.001)
    wide[0, 3], wide[0, [70, 200]] = 0.5, 0.4  # 2 of 256: torch's heap path, the 2nd tied
    assert not numba_glue._reproduced(256, 2)
    assert glue.route_topk(wide, 2, False, torch.float32) is None
    assert glue.route_topk(wide, 1, False, torch.float32) is not None  # no tie at the 1st


def _tied_rows(gen: np.random.Generator, n: int, count: int) -> list[np.ndarray]:
    """Float32 rows of n values drawn from few levels (every row full of ties)."""
    rows = []
    for i in range(count):
        levels = int(gen.integers(1, max(2, n // int(gen.integers(1, 8))) + 1))
        rows.append((gen.integers(0, levels, n) / levels).astype(np.float32))
        if i % 3 == 0:
            rows[-1] = (np.round(gen.random(n) * 8) / 8).astype(np.float32)
    return rows


def _assert_torch_topk(row: np.ndarray, k: int) -> None:
    n = row.shape[0]
    values, ids = np.empty(n, np.float32), np.empty(n, np.int64)
    numba_glue._torch_topk(row, n, k, values, ids)
    want = torch.topk(torch.from_numpy(row), k)
    assert ids[:k].tolist() == want.indices.tolist(), (row.tolist(), k)
    assert np.array_equal(values[:k], want.values.numpy())


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 16, 32, 60, 64, 100, 128, 256, 384])
def test_torch_topk_on_ties(n) -> None:
    """numba_glue._torch_topk gives torch.topk's indices, in its order, on rows full of ties,
    for every k it reproduces at this length."""
    gen = np.random.default_rng(n)
    ks = [k for k in (1, 2, 3, 4, 6, 8, 10, 16, 17) if k <= n and numba_glue._reproduced(n, k)]
    assert ks
    for k in ks:
        for row in _tied_rows(gen, n, 120):
            _assert_torch_topk(row, k)


def _past_the_depth_limit(row: np.ndarray, k: int) -> tuple[bool, int]:
    """(whether _torch_topk's introselect ends past its depth limit on `row`, the partitions
    it made): its loop restated around numba_glue._partition."""
    n, v, ix = row.shape[0], row.copy(), np.arange(row.shape[0])
    first, last, depth, count = 0, n, 2 * (n.bit_length() - 1), 0
    while last - first > 3 and depth > 0:
        depth, count = depth - 1, count + 1
        cut = numba_glue._partition(v, ix, first, last)
        first, last = (cut, last) if cut <= k - 1 else (first, cut)
    return last - first > 3, count


def test_torch_topk_past_the_depth_limit() -> None:
    """Rows that drive the introselect past its depth limit (found by a search that keeps the
    swaps which make more partitions): torch.topk's heap select, reproduced."""
    gen, n, k, found = np.random.default_rng(1), 64, 8, []
    while len(found) < 4:
        row = gen.random(n).astype(np.float32)
        score = _past_the_depth_limit(row, k)[1]
        for _ in range(3000):
            candidate = row.copy()
            i, j = gen.integers(0, n, 2)
            candidate[i], candidate[j] = candidate[j], candidate[i]
            if gen.random() < 0.2:  # ties too
                candidate[gen.integers(0, n)] = candidate[gen.integers(0, n)]
            past, partitions = _past_the_depth_limit(candidate, k)
            if past:
                found.append(candidate)
                break
            if partitions >= score:
                row, score = candidate, partitions
    for row in found:
        _assert_torch_topk(row, k)


def _softmax_topk(logits: torch.Tensor, k: int, any_order: bool):
    """numba_glue.softmax_topk_route of float32 logits [T, E] with renormalised float32
    weights: (ids, weights), or None where it refuses."""
    T, E = logits.shape
    ids, weights = torch.empty(T, k, dtype=torch.int64), torch.empty(T, k)
    ok = numba_glue.softmax_topk_route(
        logits.data_ptr(), False, ids.data_ptr(), weights.data_ptr(), False, T, E, k, True,
        glue.softmax_lanes(), any_order,
    )  # fmt: skip
    return (ids, weights) if ok else None


@pytest.mark.skipif(glue.softmax_lanes() is None, reason="torch's softmax is not reproduced here")
def test_any_order_routes_ties_inside_the_k_only() -> None:
    """Where torch.topk's path is not reproduced (4 of 256), with any_order (the attention
    block computing the experts) a tie among the k largest routes: route_torch's experts and
    weights, the tied ids lowest first; a tie at the k-th place is refused either way, and
    without any_order every tie is."""
    assert not numba_glue._reproduced(256, 4)
    inside = torch.full((1, 256), -10.0)
    inside[0, :6] = torch.tensor([1.0, 3.0, 2.0, 3.0, 0.5, 2.5])  # the two largest equal
    assert _softmax_topk(inside, 3, any_order=False) is None
    ids, weights = _softmax_topk(inside, 3, any_order=True)
    want_ids, want_weights = routing.route_torch(inside, 3, True)
    assert ids.tolist() == [[1, 3, 5]]
    assert sorted(ids[0].tolist()) == sorted(want_ids[0].tolist())
    assert torch.equal(weights, want_weights)  # equal values: the same sequence
    at_k = torch.full((1, 256), -10.0)
    at_k[0, :5] = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.5])  # the 2nd and 3rd largest equal
    assert _softmax_topk(at_k, 2, any_order=True) is None
    assert _softmax_topk(at_k, 3, any_order=True) is not None  # their tie inside the k
    ids, _ = _softmax_topk(at_k[:, :5].contiguous(), 2, any_order=False)  # 2 of 5: reproduced
    assert torch.equal(ids, routing.route_torch(at_k[:, :5], 2, True)[0])


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """numba_glue's softmax (the one softmax_topk_route computes) of float32 logits [T, E]."""
    x = logits.float().numpy()
    out, lanes = np.empty_like(x), glue.softmax_lanes()
    acc, swap = np.empty(lanes, np.float32), np.empty(lanes, np.float32)
    for t in range(x.shape[0]):
        numba_glue._softmax_row(x[t], out[t], x.shape[1], lanes, acc, swap)
    return torch.from_numpy(out)


def _softmax_bits_match(logits: torch.Tensor) -> None:
    """The kernel's probabilities of logits [T, E] are F.softmax's, bit for bit."""
    want = F.softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.equal(_softmax(logits).view(torch.int32), want.view(torch.int32)), logits.shape


_F32 = torch.float32
WIDTHS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 60, 64, 100, 128, 160, 256, 384, 512]


@pytest.mark.skipif(glue.softmax_lanes() is None, reason="torch's softmax is not reproduced here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_equals_torch(dtype) -> None:
    """torch's vectorised softmax on this machine's build (AVX2 or AVX512 lanes): every row
    width about the lane counts and the routers' expert counts, logits from nearly equal to
    spread over hundreds (probabilities underflowing to subnormals and 0)."""
    gen = torch.Generator().manual_seed(7)
    for width in WIDTHS:
        for scale in (0.01, 1.0, 5.0, 40.0, 300.0):
            _softmax_bits_match((torch.randn(3, width, generator=gen) * scale).to(dtype))


@pytest.mark.skipif(glue.softmax_lanes() is None, reason="torch's softmax is not reproduced here")
def test_softmax_exp_over_its_range() -> None:
    """SLEEF's expf over x - max in [-110, 0], 2^20 points: after a 0 logit, a logit d < -17
    has probability exp(d) itself (1 + exp(d) rounds to 1), so the rows show exp's bits,
    its subnormal results and its cut to 0 below -104 included."""
    d = torch.linspace(-110.0, 0.0, 1 << 20)
    logits = torch.cat((torch.zeros(d.numel() // 63, 1), d[: d.numel() // 63 * 63].view(-1, 63)), 1)
    for rows in logits.split(256):
        _softmax_bits_match(rows)


@pytest.mark.skipif(glue.softmax_lanes() is None, reason="torch's softmax is not reproduced here")
def test_softmax_route_equals_route_torch_and_leaves_ties_to_torch() -> None:
    """softmax_route's (ids, weights) are route_torch's, ties included, or None on a logit
    not finite or a tie at the k-th place where torch's pick is not reproduced (k * 64 <=
    experts; then routing.route takes torch's path)."""
    gen, routed_rows, refused = torch.Generator().manual_seed(3), 0, 0
    for experts, top_k in ((8, 2), (64, 8), (128, 8), (512, 10), (512, 8), (256, 2)):
        for _ in range(20):
            logits = (torch.randn(2, experts, generator=gen) * 2).bfloat16()
            routed = glue.softmax_route(logits, top_k, True, torch.bfloat16)
            want = routing.route_torch(logits, top_k, True)
            if routed is not None:
                routed_rows += 1
                assert torch.equal(routed[0], want[0]) and torch.equal(routed[1], want[1])
            else:  # a tie where torch's pick is not reproduced, as route_topk sees it
                assert not numba_glue._reproduced(experts, top_k)
                probs = F.softmax(logits, dim=-1, dtype=torch.float32)
                assert glue.route_topk(probs, top_k, True, torch.bfloat16) is None
                refused += 1
            got = routing.route(logits, top_k, True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert routed_rows > 0 and refused > 0
    tied = torch.tensor([[1.0, 3.0, 2.0, 3.0, 1.0]])
    routed, want = glue.softmax_route(tied, 1, False, _F32), routing.route_torch(tied, 1, False)
    assert torch.equal(routed[0], want[0]) and torch.equal(routed[1], want[1])
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert glue.softmax_route(torch.tensor([[0.0, bad, 1.0]]), 1, False, _F32) is None
    assert glue.softmax_route(torch.rand(1, 8).half(), 2, True, torch.bfloat16) is None


_OTHER_BUILD = """
import sys
import numpy as np, torch, torch.nn.functional as F
from hybridmoe.kernels import glue, numba_glue
assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
assert glue.softmax_lanes() == 8
gen = torch.Generator().manual_seed(11)
acc, swap = np.empty(8, np.float32), np.empty(8, np.float32)
for width in map(int, sys.argv[1:]):
    for scale in (0.01, 1.0, 5.0, 40.0, 300.0):
        logits = torch.randn(3, width, generator=gen) * scale
        x = logits.numpy()
        got = np.empty_like(x)
        for t in range(3):
            numba_glue._softmax_row(x[t], got[t], width, 8, acc, swap)
        want = F.softmax(logits, dim=-1).numpy()
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), width
print("ok")
"""


@pytest.mark.skipif(
    glue.softmax_lanes() != 16, reason="AVX2 lanes are this process's own build (tested above)"
)
def test_softmax_equals_torchs_avx2_build_too() -> None:
    """On an AVX512 machine torch's AVX2 build (ATEN_CPU_CAPABILITY=avx2, a process of its
    own) is reproduced with 8 lanes: a machine of either kind gets its own bits."""
    import os
    import subprocess
    import sys

    environ = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_BUILD, *map(str, WIDTHS)],
        env=environ,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_float32_array_widens_like_torch() -> None:
    """Every bfloat16 bit pattern (NaNs, infinities, subnormals) widens to torch's .float()."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert glue.MAX_NUMEL >= 1 << 16
    got = glue.float32_array(every)
    assert got is not None and got.dtype == np.float32 and got.shape == (1 << 16,)
    want = every.float().view(torch.int32).numpy()
    assert np.array_equal(got.view(np.int32), want)
    assert glue.float32_array(every[::2]) is None  # strided: torch's copy
    assert glue.float32_array(torch.ones(4)) is None  # float32: no conversion
    assert glue.float32_array(every[:0]).shape == (0,)
    assert glue.float32_array(torch.cat([every, every])) is None  # prefill-sized: torch's copy


@pytest.mark.skipif(glue.softmax_lanes() is None, reason="torch's softmax is not reproduced here")
@pytest.mark.parametrize(
    "gate_dtype,x_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
    ],
)
@pytest.mark.parametrize("weights_fp32", [False, True])
def test_router_in_one_call_equals_route_torch(gate_dtype, x_dtype, weights_fp32) -> None:
    """SoftmaxTopKRouter on the host: the gate's dense kernel, softmax and top-k in one call
    (DenseProjection.route) give route_torch's ids and weights of the gate's own logits, ties
    included; a tie where torch's pick is not reproduced (1 of 64) hands back those logits,
    bit for bit."""
    from hybridmoe.moe.routing import RouterSpec, create_router

    gen, fused = torch.Generator().manual_seed(2), 0
    for experts, hidden, top_k in ((8, 64, 2), (64, 1024, 8), (60, 128, 4)):
        for renorm in (False, True):
            gate = (torch.randn(experts, hidden, generator=gen) * 0.1).to(gate_dtype)
            spec = RouterSpec(top_k, renorm, weights_fp32)
            router = create_router("softmax_topk", {"weight": gate}, spec)
            for tokens in (1, 3):
                x = torch.randn(tokens, hidden, generator=gen).to(x_dtype)
                logits = router.gate.kernel(x)
                want = routing.route_torch(logits, top_k, renorm, weights_fp32)
                got = router(x)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                assert got[1].dtype == want[1].dtype
                dtype = torch.float32 if weights_fp32 else x_dtype
                one_call = router.gate.route(x, top_k, renorm, dtype)
                if isinstance(one_call, tuple):
                    fused += 1
                else:  # a tie: the logits
                    assert torch.equal(one_call, logits)
    assert fused > 0
    tied = create_router("softmax_topk", {"weight": torch.ones(4, 32)}, RouterSpec(2, True, False))
    x = torch.randn(1, 32)
    want = routing.route_torch(tied.gate.kernel(x), 2, True)  # torch.topk's pick among equals
    for ids, weights in (tied.gate.route(x, 2, True, torch.float32), tied(x)):
        assert torch.equal(ids, want[0]) and torch.equal(weights, want[1])
    heap = create_router("softmax_topk", {"weight": torch.ones(64, 32)}, RouterSpec(1, True, False))
    assert torch.equal(heap.gate.route(x, 1, True, torch.float32), heap.gate.kernel(x))
    assert tied.gate.route(torch.randn(32, 32), 2, True, torch.float32) is None  # prefill-sized


_ROUTE_FIRST = """
import torch
from hybridmoe.moe.routing import RouterSpec, create_router, route_torch
from hybridmoe.kernels import glue
gen = torch.Generator().manual_seed(4)
gate = (torch.randn(64, 256, generator=gen) * 0.1).bfloat16()
router = create_router("softmax_topk", {"weight": gate}, RouterSpec(8, True, False))
bad = 0
for _ in range(30):  # the one-call router compiles first in this process, its callees with it
    x = torch.randn(1, 256, generator=gen).bfloat16()
    got, want = router(x), route_torch(router.gate.kernel(x), 8, True)
    bad += not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
probs = torch.tensor([[0.1, 0.3, 0.2, 0.4]])
_, weights = glue.route_topk(probs, 2, True, torch.float32)
top = torch.tensor([[0.4, 0.3]])
bad += not torch.equal(weights, top / top.sum())
print(bad)
"""


@pytest.mark.skipif(glue.softmax_lanes() is None, reason="torch's softmax is not reproduced here")
def test_one_call_router_compiled_first_keeps_the_glue_bits(tmp_path) -> None:
    """The one-call router compiled before any glue kernel, in a process with an empty kernel
    cache, then the glue's own top-k: both still route_torch's bits (a fastmath router entry
    once compiled the top-k's callees with 'arcp' and cached them so: every renormalised
    weight an ulp off, in that process and every later one)."""
    import os
    import subprocess
    import sys

    environ = dict(os.environ, HYBRIDMOE_CACHE_DIR=str(tmp_path))
    for _ in range(2):  # compiled, then loaded from the cache
        done = subprocess.run(
            [sys.executable, "-c", _ROUTE_FIRST], env=environ, capture_output=True, text=True
        )
        assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr[-2000:]


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_one_call_router_logits_are_the_dense_kernels(x_dtype) -> None:
    """DENSE_ROUTE's logits (left in the caller's arrays) are the dense kernel's bits."""
    from hybridmoe.kernels import numba_dense
    from hybridmoe.kernels.host_arrays import host_array
    from hybridmoe.kernels.projection import DenseProjection

    if glue.softmax_lanes() is None:
        pytest.skip("torch's softmax is not reproduced here")
    gen = torch.Generator().manual_seed(6)
    gate = DenseProjection((torch.randn(64, 1024, generator=gen) * 0.1).to(x_dtype))
    call = gate._prepare()
    for tokens in (1, 3):
        x = torch.randn(tokens, 1024, generator=gen).to(x_dtype)
        ids, weights = torch.empty(tokens, 8, dtype=torch.int64), torch.empty(tokens, 8)
        bf16 = x_dtype == torch.bfloat16
        empty32, empty16 = np.empty(0, np.float32), np.empty(0, np.uint16)
        y = empty32 if bf16 else np.empty(tokens * 64, np.float32)
        y_bits = np.empty(tokens * 64, np.uint16) if bf16 else empty16
        numba_dense.DENSE_ROUTE[gate.fmt.name](
            call._w, call._row_bytes, 1024, 64,
            empty32 if bf16 else host_array(x, np.float32),
            host_array(x, np.uint16) if bf16 else empty16,
            tokens, call._bias, y, y_bits, call._item_rows, ids.data_ptr(), weights.data_ptr(),
            False, 8, True, glue.softmax_lanes(),
        )  # fmt: skip
        logits = torch.from_numpy(y_bits).view(torch.bfloat16) if bf16 else torch.from_numpy(y)
        assert torch.equal(logits.view(tokens, 64), gate.kernel(x))
