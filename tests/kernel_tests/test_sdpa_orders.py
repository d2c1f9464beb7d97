"""The decode attention kernel's arithmetic against torch's own pieces, where the kernel
reproduces this machine's SDPA (numba_attention.gives_sdpa_bits). Finer than output bits: a
bfloat16 output hides most last bits of its float32 sums (an order off in one place of a
GEMM changed about one output element in 4 million), so kernels/attention_reference.py's
pieces (which the kernel computes bit for bit on every path: tests/layers/
test_decode_attention.py) are compared with torch's:
- its two GEMM orders (the machine's: numba_attention.kernel_order) with the GEMM torch's
  flash attention calls, MKL's cblas_gemm_bf16bf16f32 (exported by libtorch_cpu), float32
  results bit for bit, over head sizes, key counts of every remainder mod 8, beta 0 and 1;
- its softmax's running max and sum with SDPA's logsumexp (max + logf(sum), whose float32
  bits move with the sum's last bit), rows of one to three blocks of every length mod 32.
Skipped where the kernel does not reproduce SDPA or torch has no MKL."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os

import numpy as np
import pytest
import torch

from hybridmoe.kernels import numba_attention
from hybridmoe.kernels.attention_reference import attend_row, dot, weigh

COL_MAJOR, NO_TRANS, TRANS = 102, 111, 112


def _mkl_gemm():
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    gemm = getattr(library, "cblas_gemm_bf16bf16f32", None)
    if gemm is not None:
        ints, pointer, real = [ctypes.c_int] * 6, ctypes.c_void_p, ctypes.c_float
        gemm.argtypes = [*ints, real, pointer, ctypes.c_int, pointer, ctypes.c_int, real]
        gemm.argtypes += [pointer, ctypes.c_int]
    return gemm


GEMM = _mkl_gemm()
pytestmark = pytest.mark.skipif(
    GEMM is None or not numba_attention.gives_sdpa_bits(4, 1, 64),
    reason="torch has no MKL bf16 GEMM, or the kernel does not reproduce this machine's SDPA",
)


@pytest.fixture(autouse=True)
def one_thread():
    """MKL on one thread, as SDPA calls it (inside its own parallel region): on two, MKL
    splits a small GEMM otherwise and sums it in another order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bf16(gen: torch.Generator, *shape: int, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


@pytest.mark.parametrize("dim", [8, 20, 64, 96, 128, 6])
def test_scores_are_mkls(dim: int) -> None:
    """A block's scores q . k: SDPA's GEMM(T, N, keys, 1, D) against attention_reference.dot."""
    gen = torch.Generator().manual_seed(dim)
    for keys in (1, 3, 7, 31, 130, 512):
        k, q = _bf16(gen, keys, dim), _bf16(gen, dim)
        mkl = np.zeros(keys, np.float32)
        GEMM(COL_MAJOR, TRANS, NO_TRANS, keys, 1, dim, 1.0, k.data_ptr(), dim, q.data_ptr(), dim,
             0.0, mkl.ctypes.data, keys)  # fmt: skip
        qf, kf = q.float().numpy(), k.float().numpy()
        order = numba_attention.kernel_order()
        ours = np.array([dot(qf, kf[j], order) for j in range(keys)], np.float32)
        assert np.array_equal(ours, mkl), f"{dim} dims, {keys} keys"


@pytest.mark.parametrize("dim", [8, 32, 64, 80, 128])
def test_weighted_values_are_mkls(dim: int) -> None:
    """A block's weighted values: SDPA's GEMM(N, N, D, 1, keys) with beta 0 (its first block)
    and 1 (the next, onto the running output) against attention_reference.weigh."""
    gen = torch.Generator().manual_seed(dim)
    for keys in (*range(1, 18), 47, 127, 130, 512):
        for beta in (0.0, 1.0):
            v = _bf16(gen, keys, dim)
            p = (torch.rand(keys, generator=gen) ** 8).bfloat16()  # a softmax's many small ones
            start = (torch.randn(dim, generator=gen) * 3).numpy() * beta
            mkl = start.astype(np.float32)
            GEMM(COL_MAJOR, NO_TRANS, NO_TRANS, dim, 1, keys, 1.0, v.data_ptr(), dim,
                 p.data_ptr(), keys, beta, mkl.ctypes.data, dim)  # fmt: skip
            ours = start.astype(np.float32)
            weigh(ours, p.float().numpy(), v.float().numpy(), numba_attention.kernel_order())
            assert np.array_equal(ours, mkl), f"{dim} dims, {keys} keys, beta {beta}"


def _logf():
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.logf.restype, libm.logf.argtypes = ctypes.c_float, [ctypes.c_float]
    return libm.logf


@pytest.mark.parametrize("dim", [64, 128])
def test_softmax_sums_are_sdpas(dim: int) -> None:
    """SDPA's logsumexp (torch's flash attention: max + std::log(sum)) of rows over one to
    three blocks, every length mod 32, against attention_reference's max and sum."""
    logf = _logf()
    gen = torch.Generator().manual_seed(dim)
    lanes, scale = numba_attention.softmax_lanes(), np.float32(1.0 / math.sqrt(dim))
    lengths, heads = [*range(1, 66), *range(500, 580), 1041, 1100], 8
    for keys in lengths:
        q = _bf16(gen, 1, heads, 1, dim)
        k, v = _bf16(gen, 1, heads, keys, dim), _bf16(gen, 1, heads, keys, dim)
        lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[1]
        for head in range(heads):
            rows = [t[0, head].float().numpy() for t in (k, v)]
            visible = np.ones(keys, bool)
            _, top, total = attend_row(q[0, head, 0].float().numpy(), *rows, visible, scale,
                                       lanes, True, numba_attention.kernel_order())  # fmt: skip
            ours = np.float32(np.float32(top) + np.float32(logf(float(total))))
            assert ours == np.float32(lse[0, head, 0].item()), f"{dim} dims, {keys} keys"
