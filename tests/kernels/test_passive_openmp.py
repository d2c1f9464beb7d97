"""env.passive_openmp around torch's import makes the process's OpenMP runtime (torch's
libgomp, which numba's OpenMP layer binds to as well) wait passively: right after a parallel
region its pool threads are asleep, where libgomp's default leaves them spinning (checked too,
so the test can fail); and OMP_WAIT_POLICY is restored after."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, threading
from hybridmoe import env
with env.passive_openmp():
    import torch
torch.set_num_threads(2)
a = torch.ones(1 << 22)
me = threading.get_native_id()
running = 0
for _ in range(20):
    a.mul_(1.0)  # a parallel region on 2 threads
    states = []
    for task in os.listdir("/proc/self/task"):
        if int(task) != me:
            stat = open(f"/proc/self/task/{task}/stat").read()
            states.append(stat.rsplit(")", 1)[1].split()[0])
    running += states.count("R")
print(json.dumps({"running": running, "policy": os.environ.get("OMP_WAIT_POLICY")}))
"""


def _probe(passive: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["HYBRIDMOE_PASSIVE_OPENMP"] = "1" if passive else "0"
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores for a parallel region")
def test_pool_threads_sleep_after_a_region_unless_switched_off():
    passive, spinning = _probe(True), _probe(False)
    assert passive["policy"] is None and spinning["policy"] is None  # restored / never set
    # 20 samples right after a region: spinning threads are runnable in most of them
    assert spinning["running"] >= 10, spinning
    assert passive["running"] <= 5, passive
