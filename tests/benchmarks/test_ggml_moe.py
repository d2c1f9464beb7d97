"""ggml_moe.py, llama.cpp's MoE layer that bench_cpu_moe.py --llamacpp times beside ours: on
the same bank bytes and routes it computes our layer's sum, so the bench compares two layers
doing the same work. llama.cpp always quantises the activations for a quantised type's integer
dots, so those are compared with our bank under activation_quant q8: for the k-quants our
contract is its q8_K arithmetic (equal to float32 rounding, measured ~1e-7), for q4_0 / q8_0
within its q8_0 blocks' fp16 scales (ours are float32); float32 weights with our float path to
float32 rounding, bf16 ones within its x rounded to bf16. Needs llama-cpp-python (the bench
extra): skipped without it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import ggml_moe  # noqa: E402
from bench_cpu_moe import Shape, make_bank, routes  # noqa: E402

from hybridmoe.moe.cpu_experts import fused_cpu_moe  # noqa: E402

pytestmark = pytest.mark.skipif(not ggml_moe.available(), reason="llama-cpp-python absent")
SHAPE = Shape(hidden=512, inter=256, experts=6, top_k=2)
# format -> (our bank's activation quantisation, the relative error allowed)
REFERENCE = {
    "f32": ("none", 1e-5),
    "bf16": ("none", 1e-2),
    "q8_0": ("q8", 1e-2),
    "q4_0": ("q8", 1e-2),
    "q2_k": ("q8", 1e-5),
    "q4_k": ("q8", 1e-5),
    "q5_k": ("q8", 1e-5),
    "q6_k": ("q8", 1e-5),
}


@pytest.mark.parametrize("fmt", sorted(REFERENCE))
@pytest.mark.parametrize("tokens", [1, 3])
def test_llamacpp_layer_computes_our_sum(fmt: str, tokens: int) -> None:
    bank = make_bank(SHAPE, fmt)  # gate_up stacked: the layer takes its gate and up views
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, SHAPE.hidden, generator=g)
    ids, weights = routes(SHAPE, tokens, False, g)
    layer = ggml_moe.GgmlMoeLayer(fmt, bank.gate, bank.up, bank.down, tokens, SHAPE.top_k, 2)
    try:
        layer.set_inputs(x, ids, weights)
        theirs = torch.from_numpy(layer.compute().copy())
        layer.set_inputs(x, ids.flip(1), weights.flip(1))  # inputs are read at each compute
        again = torch.from_numpy(layer.compute().copy())
    finally:
        layer.close()
    quant, tolerance = REFERENCE[fmt]
    ours = fused_cpu_moe(x, ids, weights, bank.with_activation_quant(quant))
    assert ((theirs - ours).norm() / ours.norm()).item() < tolerance
    torch.testing.assert_close(again, theirs, rtol=1e-5, atol=1e-6)


def test_a_format_without_a_ggml_type_is_named() -> None:
    bank = make_bank(SHAPE, "f32")
    with pytest.raises(ValueError, match="no ggml type for format 'q9_9'"):
        ggml_moe.GgmlMoeLayer("q9_9", bank.gate, bank.up, bank.down, 1, SHAPE.top_k, 1)


def test_a_bank_of_another_layout_is_refused() -> None:
    bank = make_bank(SHAPE, "q8_0")
    with pytest.raises(ValueError, match="not the same block layout"):
        ggml_moe.GgmlMoeLayer("q4_0", bank.gate, bank.up, bank.down, 1, SHAPE.top_k, 1)
