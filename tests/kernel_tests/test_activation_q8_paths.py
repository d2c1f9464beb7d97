"""Every integer-dot instruction path of the q8 tile (kernels/numba_simd_q8.py) that this
machine can run, against the torch reference, bit for bit: each in its own process, numba
compiling for the host with the features above that path taken away (NUMBA_CPU_FEATURES), so
an AVX-512 machine also tests the AVX-VNNI, AVX2 and portable code of the AVX2-only ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from numba.core.codegen import get_host_cpu_features

HOST = get_host_cpu_features().split(",")
SCRIPT = Path(__file__).with_name("q8_tile_check.py")
# what AVX2 brings and everything above it: without them numba compiles the portable IR (for
# AVX1; NUMBA_CPU_NAME=x86-64 with SSE2 only crashed the process in numba, not looked into)
ABOVE_AVX = ("avx2", "avx512", "amx", "avxvnni", "avx10", "avxifma", "avxneconvert")
ABOVE_AVX += ("vpclmulqdq", "vaes", "gfni")


def _without(prefixes: tuple[str, ...]) -> str:
    """The host's features with those named by any of `prefixes` turned off."""
    return ",".join("-" + f[1:] if f[1:].startswith(prefixes) else f for f in HOST)


# path -> (what it needs of the host, the environment that makes numba compile it)
PATHS = {
    "vnni (avx512)": ("+avx512vnni", {}),
    "vnni (avx-vnni)": ("+avxvnni", {"NUMBA_CPU_FEATURES": _without(("avx512", "amx"))}),
    "avx2": (
        "+avx2",
        {"NUMBA_CPU_FEATURES": _without(("avx512", "amx", "avxvnni", "avx10"))},
    ),
    "portable": ("+avx", {"NUMBA_CPU_FEATURES": _without(ABOVE_AVX)}),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_instruction_path_matches_the_reference(path: str) -> None:
    needs, extra = PATHS[path]
    if needs not in HOST:
        pytest.skip(f"this machine lacks {needs[1:]}")
    env = {**os.environ, **extra}
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["path"] == path.split(" ")[0]
    assert result["failures"] == []


@pytest.mark.parametrize(("name", "gathered"), [("q4_0", True), ("q8_0", False)])
def test_block_scales_are_gathered_where_the_target_permutes_words(name, gathered) -> None:
    """The q8 tile's 8 block scales of a q4_0 row come from one load and one word permute on
    AVX-512 BW targets (numba_simd_q8._gathered_scales: the same bits as the inserts, which the
    instruction paths above check; this checks that the faster IR is the one emitted), and
    from inserts elsewhere and for q8_0 (GATHER_WORDS)."""
    from llvmlite import ir

    from hybridmoe.kernels import numba_simd_q8 as simd_q8
    from hybridmoe.kernels.llvm_ir import I8, i64, target_has
    from hybridmoe.quant.formats import weight_format

    kernel = weight_format(name).kernel
    function = ir.Function(
        ir.Module(), ir.FunctionType(ir.VoidType(), [I8.as_pointer()]), name="scales"
    )
    builder = ir.IRBuilder(function.append_basic_block())
    group = function.args[0]
    scale_ptrs = []
    for b in range(simd_q8.LANES):
        block = builder.gep(group, [i64(b * kernel.block_bytes)])
        scale_ptrs.append((kernel.int8_block_ir(builder, block)[1], block))
    bits = simd_q8._gathered_scales(builder, kernel, group, scale_ptrs)
    assert (bits is not None) == (gathered and target_has("avx512bw"))
    moved = [(builder.gep(d, [i64(1)]), block) for d, block in scale_ptrs]  # not at the start
    assert simd_q8._gathered_scales(builder, kernel, group, moved) is None
