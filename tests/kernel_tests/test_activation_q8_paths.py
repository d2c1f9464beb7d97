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
