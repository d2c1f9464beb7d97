"""The dense kernel's vector loop (kernels/dense_ir.py: <32 x float> IR that LLVM splits into
the target's registers) compiled for narrower targets than this machine, against the scalar
reference bit for bit: each in its own process, numba compiling with the host's AVX-512 (and
AVX2) features taken away (NUMBA_CPU_FEATURES), so an AVX-512 machine also checks the code an
AVX2-only or AVX-only machine runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from numba.core.codegen import get_host_cpu_features

HOST = get_host_cpu_features().split(",")
SCRIPT = Path(__file__).with_name("dense_target_check.py")
ABOVE_AVX2 = ("avx512", "amx", "avxvnni", "avx10", "avxifma", "avxneconvert")
ABOVE_AVX = (*ABOVE_AVX2, "avx2", "vpclmulqdq", "vaes", "gfni")


def _without(prefixes: tuple[str, ...]) -> str:
    return ",".join("-" + f[1:] if f[1:].startswith(prefixes) else f for f in HOST)


TARGETS = {  # the widest features left -> (what the host needs, NUMBA_CPU_FEATURES)
    "avx512f": ("+avx512f", None),
    "avx2": ("+avx2", _without(ABOVE_AVX2)),
    "avx": ("+avx", _without(ABOVE_AVX)),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_kernel_matches_the_reference_on_the_target(target: str, tmp_path: Path) -> None:
    needs, features = TARGETS[target]
    if needs not in HOST:
        pytest.skip(f"this machine lacks {needs[1:]}")
    env = {**os.environ, "HYBRIDMOE_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_CACHE_DIR", None)
    if features is not None:
        env["NUMBA_CPU_FEATURES"] = features
    tests_dir = str(Path(__file__).parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"widest": target, "failures": []}
