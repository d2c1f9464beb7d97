"""Compiles the numba kernels that most of the suite calls into the on-disk kernel cache
(HYBRIDMOE_CACHE_DIR), shard SHARD of SHARDS: `python tests/warm_kernels.py SHARD SHARDS`.

A cold compile of one format's fused kernel takes ~10 s on an idle core (minutes on a busy
one) and a fresh clone starts with an empty cache. Without this, each pytest-xdist worker
meets every kernel cold at about the same time and both compile it; with it (conftest.py,
`--warm-kernels`) the compiles are split across the cores once, before any test starts, and
the tests load the kernels from the cache. The calls are the ones the tests make (flat
C-contiguous arrays: one signature a kernel), so the cached code is what the tests would have
compiled. Nothing is checked here: a kernel this misses, or one that fails to compile, is
compiled (and fails) in the tests that call it, as without the warm-up."""

from __future__ import annotations

import sys

import torch

from hybridmoe.kernels.numba_dense import dense_linear, weight_bytes
from hybridmoe.moe.cpu_experts import fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format
from random_weights import random_bank, random_stored, whole_blocks

# the dense projections' formats the suite's models and tests/kernel_tests/test_dense_kernel.py use
DENSE_FORMATS = ("f32", "bf16", "f16", "q8_0", "q4_0", "q4_k")


def _fused(name: str, activation_quant: str = "none") -> None:
    bank = random_bank(name, 4, whole_blocks(64, name), whole_blocks(32, name))
    if activation_quant != "none":
        bank = bank.with_activation_quant(activation_quant)
    ids, weights = torch.tensor([[0, 1]]), torch.ones(1, 2)
    fused_cpu_moe(torch.ones(1, bank.hidden_size), ids, weights, bank)


def _fused_q8_pair(gate_up_name: str, down_name: str) -> None:
    """The q8 layer kernel of a pair of formats (gate/up, down) the suite mixes."""
    gen = torch.Generator().manual_seed(0)
    gate_up_fmt, down_fmt = weight_format(gate_up_name), weight_format(down_name)
    gate_up = random_stored(gate_up_fmt, (2, 512, 256), gen)
    down = random_stored(down_fmt, (2, 256, 256), gen)
    bank = ExpertBank(gate_up, down, gate_up_fmt, down_fmt=down_fmt, activation_quant="q8")
    fused_cpu_moe(torch.ones(1, 256), torch.tensor([[0, 1]]), torch.ones(1, 2), bank)


# the (gate/up, down) pairs of k-quant banks the suite computes with q8 activations
Q8_PAIRS = (("q4_k", "q6_k"), ("q4_k", "q5_k"), ("q5_k", "q8_0"), ("q2_k", "q3_k"))


def _quantize(name: str) -> None:
    """Quantising a float bank (the converters of q8_0 and q4_0 are numba kernels)."""
    gate_up, down = torch.ones(2, 64, 64), torch.ones(2, 64, 32)
    ExpertBank(gate_up, down).converted(weight_format(name))


def _dense(name: str, activation_quant: str = "none") -> None:
    fmt = weight_format(name)
    cols = whole_blocks(64, name)
    stored = random_stored(fmt, (8, cols), torch.Generator().manual_seed(0))
    x = torch.ones(1, cols)
    if activation_quant == "q8":
        from hybridmoe.kernels.numba_dense_q8 import dense_linear_q8

        dense_linear_q8(fmt, weight_bytes(stored), 8, x)
    else:
        dense_linear(fmt, weight_bytes(stored), 8, x)


def _attention(dtype: torch.dtype, threads: int) -> None:
    """The decode attention kernel (serial or on numba's pool) of a bfloat16 or float32 cache."""
    import numpy as np

    from hybridmoe.kernels import numba_attention

    caches = [torch.zeros(2, 2, 16, 8, dtype=dtype) for _ in "kv"]
    q, k, v = torch.ones(1, 1, 4, 8, dtype=dtype), *(torch.ones(1, 1, 2, 8, dtype=dtype),) * 2
    host = tuple(numba_attention.cache_array(c) for c in caches)
    rows, positions = np.array([0]), np.array([3])
    numba_attention.decode_attention(q, k, v, host, 16, rows, positions, 4, None, None, threads)


def _block(dtype: torch.dtype) -> None:
    """The attention block (kernels/attention_block.py) of bfloat16 or float32 weights, as a
    decode step of one sequence calls it."""
    from types import SimpleNamespace

    import numpy as np

    from hybridmoe.kernels import attention_block, glue, numba_attention
    from hybridmoe.kernels.projection import DenseProjection

    heads, kv_heads, dim, hidden, slots = 4, 2, 8, 16, 16
    qkv = DenseProjection(torch.ones((heads + 2 * kv_heads) * dim, hidden, dtype=dtype))
    o = DenseProjection(torch.ones(hidden, heads * dim, dtype=dtype))
    norm, rope = torch.ones(dim, dtype=dtype), torch.ones(1, 1, dim, dtype=dtype)
    caches = [torch.zeros(2, kv_heads, slots, dim, dtype=dtype) for _ in "kv"]
    host = tuple(numba_attention.cache_array(c) for c in caches)
    rows, positions = np.zeros(1, np.int64), np.full(1, 3, np.int64)
    batch = SimpleNamespace(kv_len=4, cos=rope, sin=rope)
    step = (host, slots, rows, positions, None, None)
    x = torch.ones(1, 1, hidden, dtype=dtype)
    lanes = glue.softmax_lanes()
    if lanes is not None:
        shape = (heads, kv_heads, dim)
        attention_block._run(qkv, o, norm, norm, 1e-6, x, batch, step, shape, lanes)


def _head(name: str) -> None:
    """The head block (the final norm, a dense head of format `name`, the logits) of bfloat16
    and float32 steps: one entry per format."""
    from hybridmoe.kernels.head_block import decode_head
    from hybridmoe.kernels.projection import DenseProjection

    fmt = weight_format(name)
    cols = whole_blocks(64, name)
    stored = random_stored(fmt, (8, cols), torch.Generator().manual_seed(0))
    head = DenseProjection(stored, None, fmt, cols)
    for dtype in (torch.bfloat16, torch.float32):
        x, scale = torch.ones(1, 1, cols, dtype=dtype), torch.ones(cols, dtype=dtype)
        decode_head(x, torch.zeros(1, 1, cols), scale, 1e-6, head, {})


def jobs() -> list[tuple]:
    """(function, format name, ...) for every kernel warmed, in a fixed order."""
    out: list[tuple] = [(_fused, name) for name in WEIGHT_FORMATS]
    q8 = [n for n, f in WEIGHT_FORMATS.items() if f.kernel.int8_block_ir is not None]
    out += [(_fused, name, "q8") for name in q8]
    out += [(_fused_q8_pair, *pair) for pair in Q8_PAIRS]
    out += [(_dense, name) for name in DENSE_FORMATS if name in WEIGHT_FORMATS]
    # the q8 kernel (the default for these formats' projections: --activation-quant auto)
    out += [(_dense, name, "q8") for name in ("q8_0", "q4_0", "q4_k")]
    out += [(_quantize, n) for n, f in WEIGHT_FORMATS.items() if f.is_quantized and f.can_quantize]
    out += [
        (_attention, dtype, threads)
        for dtype in (torch.bfloat16, torch.float32)
        for threads in (1, 2)
    ]
    out += [(_block, dtype) for dtype in (torch.bfloat16, torch.float32)]
    out += [(_head, name) for name in ("bf16", "f32")]  # the tests' models' heads
    return out


def main(shard: int, shards: int) -> None:
    for job in jobs()[shard::shards]:
        job[0](*job[1:])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
