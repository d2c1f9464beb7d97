"""`--dtype auto` on a GGUF file: bfloat16 where its matrices are BF16 (a bf16 checkpoint's
rule), float32 otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridmoe.models.loading import gguf_stored_dtype


def gguf_of(*tensors: tuple[str, tuple[int, ...], str]) -> SimpleNamespace:
    """What gguf_stored_dtype reads of a GgufFile: its tensors' shapes and type names."""
    return SimpleNamespace(
        tensors={
            name: SimpleNamespace(shape=shape, type_name=kind) for name, shape, kind in tensors
        }
    )


NORMS = (("blk.0.attn_norm.weight", (64,), "F32"), ("output_norm.weight", (64,), "F32"))
ROUTER = ("blk.0.ffn_gate_inp.weight", (8, 64), "F32")  # F32 at every file type
EXPERTS = ("blk.0.ffn_gate_exps.weight", (8, 32, 64), "Q4_K")


@pytest.mark.parametrize(
    ("dense", "expected"),
    [
        (["BF16", "BF16"], torch.bfloat16),  # bench_vs_llamacpp's files: experts quantised
        (["Q4_K", "Q6_K"], torch.float32),  # a downloaded Q4_K_M: every matrix quantised
        (["BF16", "Q6_K"], torch.float32),
        (["BF16", "F16"], torch.float32),
        (["F32", "F32"], torch.float32),
    ],
)
def test_auto_dtype_of_a_gguf(dense, expected):
    matrices = [
        ("blk.0.attn_q.weight", (64, 64), dense[0]),
        ("output.weight", (100, 64), dense[1]),
    ]
    assert gguf_stored_dtype(gguf_of(*NORMS, ROUTER, EXPERTS, *matrices)) == expected


def test_a_shared_experts_gate_does_not_count_either():
    shared_gate = ("blk.0.ffn_gate_inp_shexp.weight", (1, 64), "F32")
    matrices = [("blk.0.attn_q.weight", (64, 64), "BF16"), shared_gate]
    assert gguf_stored_dtype(gguf_of(*NORMS, ROUTER, *matrices)) == torch.bfloat16


def test_a_file_without_float_matrices_is_float32():
    assert gguf_stored_dtype(gguf_of(*NORMS, ROUTER, EXPERTS)) == torch.float32
