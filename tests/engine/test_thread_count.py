"""An engine built with threads=1 on the cpu device keeps one thread for torch's ops and its
dense kernels, although starting numba's OpenMP pool (which shares torch's libgomp) sets the
OpenMP thread count to the pool's size. In a fresh process: the pool starts once per process,
so in this one an earlier test may have started it already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, sys
import torch
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.kernels import numba_dense, numba_moe
from hybridmoe.moe.config import OffloadConfig

launches, real = [], numba_moe.launch
def counting(kernel, threads, *args):
    launches.append(threads)
    return real(kernel, threads, *args)
numba_moe.launch = numba_dense.launch = counting
offload = OffloadConfig(decode_target="cpu", cpu_threads=1)
config = EngineConfig(dtype="float32", threads=1, offload=offload)
with Engine.from_pretrained(sys.argv[1], config) as engine:
    built = torch.get_num_threads()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate_ids([[1, 2, 3]], params)
    print(json.dumps({"pool": numba_moe.max_threads(), "built": built,
                      "after": torch.get_num_threads(), "launches": sorted(set(launches))}))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores: one thread is the default")
def test_threads_1_stays_1_after_the_pool_starts(demo_checkpoint: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(demo_checkpoint)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["pool"] >= 2, seen  # the pool has more threads than the engine may use
    assert seen["built"] == seen["after"] == 1, seen
    assert seen["launches"] == [1], seen
