"""Run by test_decode_attention.test_every_instruction_path_matches_sdpa in a process of its
own, compiled for the instruction path NUMBA_CPU_FEATURES gives: decode steps of the kernel
against SDPA within the contract (the test module's Pair), bfloat16 and float32, a ring and a
window, a head size with a tail; prints {"lanes", "fma", "steps"} as its last line."""

from __future__ import annotations

import json

import torch

from hybridmoe.kernels import attention_ir, llvm_ir, numba_attention
from layers.test_decode_attention import Pair, config, decode_steps


def main() -> None:
    steps, calls, kernel = 0, [], numba_attention.decode_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    numba_attention.decode_attention = counting
    for dtype in (torch.bfloat16, torch.float32):
        for ring in (True, False):
            for heads, kv_heads, head_dim in ((16, 4, 64), (12, 4, 20)):
                pair = Pair(config(heads, kv_heads, head_dim, 4), 40, dtype, ring)
                steps += decode_steps(pair, 4)
    assert len(calls) == 2 * steps, (len(calls), steps)  # both layers of every decode step
    lanes = attention_ir.lanes()
    print(json.dumps({"lanes": lanes, "fma": llvm_ir.target_has("fma"), "steps": steps}))


if __name__ == "__main__":
    main()
