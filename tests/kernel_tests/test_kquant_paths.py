"""The tile of the k-quants and of the 32-weight block formats (q4_0 ... q8_0, mxfp4)
(kernels/numba_simd.py with the formats' IR in quant/), on every instruction path this machine
can run: AVX-512 with VBMI and GFNI (q5_k and q6_k assemble their integers 64 bytes at a time),
AVX-512 without them (q4_k, q4_0, q4_1, q5_0, q5_1 and mxfp4 look their weights up in a
per-block table), AVX2 (mxfp4: a byte shuffle) and portable code (the weights converted and
scaled), each in its own process compiled for the host with features taken away
(NUMBA_CPU_FEATURES). Every path gives the same bits (each weight is the same float, summed in
the same order), and those are the float64 dot products of the torch dequantisation to within
fp32 summation error. The same IR expands rows to float32 (kernels/numba_dequantize.py): on
every path those are the torch dequantisers' bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridmoe.quant.formats import weight_format
from kernel_tests.test_activation_q8_paths import ABOVE_AVX, HOST, _without

SCRIPT = Path(__file__).with_name("kquant_tile_check.py")
sys.path.insert(0, str(SCRIPT.parent))
import kquant_tile_check as check  # noqa: E402

# path -> (NUMBA_CPU_FEATURES or None for the host's, what the host needs for it to be a path
# of its own, what the script must report: (avx512, byte_permutes))
PATHS = {
    "host": (None, "", None),
    "avx512": (_without(("avx512vbmi", "gfni")), "+avx512vbmi", (True, False)),
    "avx2": (_without(("avx512", "amx", "avxvnni", "avx10")), "+avx512f", (False, False)),
    "portable": (_without(ABOVE_AVX), "+avx2", (False, False)),
}


def _outputs(path: str, tmp_path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    tests = str(SCRIPT.parent.parent)
    features = PATHS[path][0]
    env = {**os.environ, **({"NUMBA_CPU_FEATURES": features} if features else {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    out = tmp_path / f"{path}.npz"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True,
        timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(out) as saved:
        return info, dict(saved)


@pytest.fixture(scope="module")
def host_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    info, outputs = _outputs("host", tmp_path_factory.mktemp("host"))
    assert info["cases"] == len(outputs) > 0
    return outputs


def test_the_expansion_is_the_torch_dequantisers(host_outputs: dict[str, np.ndarray]) -> None:
    """numba_dequantize's rows (the same IR as the tile's weights) are fmt.dequantize's bits."""
    keys = [key for key in host_outputs if key.endswith(" dequantize")]
    assert len(keys) == len(check.FORMATS)
    for key in keys:
        name = key.split()[0]
        want = weight_format(name).dequantize(check.dequantize_case(name), torch.float32)
        assert np.array_equal(host_outputs[key], want.view(torch.int32).numpy()), key


def test_the_tile_is_the_float64_dot_product(host_outputs: dict[str, np.ndarray]) -> None:
    for key, out in host_outputs.items():
        if key.endswith(" dequantize"):
            continue
        name, shape, supers = key.split()
        wrows, xrows = map(int, shape.split("x"))
        stored, x, offs = check.case(name, wrows, xrows, int(supers))
        w = weight_format(name).dequantize(stored).double()  # [wrows, n]
        rows = x.flip(0).double()[torch.from_numpy(offs) // x.shape[1]]  # row c at offs[c]
        expected = (rows @ w.T).reshape(-1).numpy()  # [c * wrows + r]
        bound = 4e-6 * (rows.abs() @ w.abs().T).reshape(-1).numpy()  # fp32 summation
        assert np.all(np.abs(out - expected) <= bound), key


@pytest.mark.parametrize("path", ["avx512", "avx2", "portable"])
def test_every_path_gives_the_same_bits(path, host_outputs, tmp_path) -> None:
    _, needs, reported = PATHS[path]
    if needs not in HOST:
        pytest.skip(f"the host has no {needs[1:]}: its own path is the {path} one")
    info, outputs = _outputs(path, tmp_path)
    assert (info["avx512"], info["byte_permutes"]) == reported
    assert outputs.keys() == host_outputs.keys()
    for key, out in outputs.items():
        assert np.array_equal(out, host_outputs[key]), f"{path}: {key}"
