"""Run by test_decode_attention.test_every_instruction_path_matches_sdpa in a process of its
own, compiled for the instruction path NUMBA_CPU_FEATURES gives: decode steps of the kernel
against SDPA within the contract (the test module's Pair), bfloat16 and float32, a ring and a
window, a head size with a tail; prints {"lanes", "fma", "steps", "sdpa_bits", "exact"} as its
last line: "exact" whether every bfloat16 step gave SDPA's bits, "sdpa_bits" whether
numba_attention.gives_sdpa_bits holds (then "exact" must), "reference_mismatches" the elements
of the test module's REFERENCE_CASES that are not kernels/attention_reference's bits (0 on every
path)."""

from __future__ import annotations

import json

import torch

from hybridmoe.kernels import attention_ir, llvm_ir, numba_attention
from hybridmoe.kernels.attention_ir import ORDERS
from layers.test_decode_attention import (
    REFERENCE_CASES,
    Pair,
    config,
    decode_steps,
    reference_mismatches,
)


def main() -> None:
    steps, calls, kernel = 0, [], numba_attention.decode_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    numba_attention.decode_attention = counting
    exact, sdpa_bits = True, True
    for dtype in (torch.bfloat16, torch.float32):
        for ring in (True, False):
            for shape in ((16, 4, 64), (12, 4, 20)):
                pair = Pair(config(*shape, 4), 40, dtype, ring)
                steps += decode_steps(pair, 4)
                if dtype == torch.bfloat16:
                    exact = exact and min(pair.equal) == 1.0
                    sdpa_bits = sdpa_bits and numba_attention.gives_sdpa_bits(*shape)
    assert len(calls) == 2 * steps, (len(calls), steps)  # both layers of every decode step
    lanes, fma = attention_ir.lanes(), llvm_ir.target_has("fma")
    info = {"lanes": lanes, "fma": fma, "steps": steps, "sdpa_bits": sdpa_bits, "exact": exact}
    dtypes = (torch.bfloat16, torch.float32)
    info["reference_mismatches"] = sum(
        reference_mismatches(dtype, case, order=order)
        for dtype in dtypes
        for case in REFERENCE_CASES
        for order in ORDERS
    )
    print(json.dumps(info))


if __name__ == "__main__":
    main()
