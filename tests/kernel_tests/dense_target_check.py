"""Run as a script (tests/kernel_tests/test_dense_kernel_targets.py does, under forced
NUMBA_CPU_FEATURES): the dense kernel (kernels/numba_dense.py) against dense_reference bit for
bit, on a few formats and token counts, compiled for whatever CPU numba targets; prints one
JSON line: the target's widest vector features and the failures."""

from __future__ import annotations

import json

import torch

from hybridmoe.kernels.llvm_ir import target_has
from hybridmoe.kernels.numba_dense import dense_linear, dense_reference, weight_bytes
from hybridmoe.quant.formats import weight_format
from random_weights import random_stored

# (format, activation dtype, rows, columns): a tail block, a super-block format
CASES = [("bf16", torch.bfloat16, 37, 200), ("f32", torch.float32, 9, 70)]
CASES += [("q8_0", torch.bfloat16, 21, 96), ("q4_k", torch.float32, 6, 512)]


def main() -> None:
    failures = []
    for name, act_dtype, rows, cols in CASES:
        fmt = weight_format(name)
        gen = torch.Generator().manual_seed(rows)
        stored = random_stored(fmt, (rows, cols), gen)
        for tokens in (1, 2, 3, 4, 5):
            x = torch.randn(tokens, cols, generator=gen).to(act_dtype)
            actual = dense_linear(fmt, weight_bytes(stored), rows, x, threads=1)
            if not torch.equal(actual, dense_reference(fmt, stored, x)):
                failures.append(f"{name} T={tokens}")
    features = [f for f in ("avx512f", "avx2", "avx") if target_has(f)]
    print(json.dumps({"widest": features[0] if features else "none", "failures": failures}))


if __name__ == "__main__":
    main()
