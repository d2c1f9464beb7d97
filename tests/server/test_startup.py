"""Starting a server: the CPU kernels are compiled (or loaded) before /health says ok, so the
first request compiles nothing; a KV cache that cannot fit is a sizing message, not a crash."""

from __future__ import annotations

import subprocess
import sys

from server.test_setup import run_serve

# In a fresh process (nothing compiled yet): build an engine on the cpu target's numba kernel
# (its CPU executor compiles the kernel while it is built), warm it up, then serve a first
# request through its scheduler; print the kernel overloads compiled after each.
SCRIPT = """
import sys
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.kernels.numba_moe import FUSED_MOE
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.server.warmup import warm_up

def overloads():
    return sum(len(kernel.overloads) for kernel in FUSED_MOE.values())

offload = OffloadConfig(decode_target="cpu", cpu_kernel="numba")
config = EngineConfig(max_batch=2, max_seq_len=64, offload=offload)
with Engine.from_pretrained(sys.argv[1], config) as engine:
    before = overloads()
    warm_up(engine)
    warm = overloads()
    assert engine._grammars is not None  # structured output's first request builds nothing
    engine.generate(["def f(x):", "hello"], SamplingParams(max_tokens=4, ignore_eos=True))
    print(before, warm, overloads())
"""


def test_the_first_request_after_warm_up_compiles_nothing(demo_checkpoint):
    command = [sys.executable, "-c", SCRIPT, str(demo_checkpoint)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    before, warm, after_request = map(int, result.stdout.split())
    assert warm >= 1 and before <= warm  # compiled by the build or the warm-up, not later
    assert after_request == warm


def test_serve_refuses_a_kv_cache_beyond_memory(demo_checkpoint):
    result = run_serve("--model", str(demo_checkpoint), "--max-batch", "1000000000000")
    assert result.returncode == 2, result.stderr
    assert "--max-batch" in result.stderr and "--max-seq-len" in result.stderr
    assert "KV cache" in result.stderr and "Traceback" not in result.stderr
