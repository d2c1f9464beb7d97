"""A first run's fused expert kernels compiled side by side in helper processes
(moe/compile_helpers.py): the caller compiles one kind of bank, a helper the other, the
caller loads the helper's work from the disk cache; nothing starts when all is cached."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridmoe.moe import compile_helpers
from hybridmoe.moe.cpu_experts import fused_cpu_moe, kernel_entry, kernel_signature
from hybridmoe.quant.bank import ExpertBank

# Builds a CpuMoeExecutor over an f32 and a bf16 bank (two kinds of kernel) in a fresh
# process; prints how many kinds compiled elsewhere, the entry points this process compiled
# itself (numba's compile events) and each bank's largest difference from bank_moe.
SCRIPT = """
import json, torch
from numba.core import event
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import bank_moe, fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank

class Names(event.Listener):
    def __init__(self):
        self.names = []
    def on_start(self, ev):
        self.names.append(ev.data["dispatcher"].py_func.__name__)
    def on_end(self, ev):
        pass

g = torch.Generator().manual_seed(0)
gate_up, down = torch.randn(2, 64, 32, generator=g), torch.randn(2, 32, 32, generator=g)
banks = [ExpertBank(gate_up.to(dtype), down.to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
names = Names()
with event.install_listener("numba:compile", names):
    executor = CpuMoeExecutor(banks, inline=True)
x, ids, w = torch.randn(1, 32, generator=g), torch.tensor([[0, 1]]), torch.rand(1, 2, generator=g)
errors = [(fused_cpu_moe(x, ids, w, b) - bank_moe(x, ids, w, b)).abs().max().item() for b in banks]
print(json.dumps([executor.kernels_compiled_elsewhere, names.names, errors]))
"""


def run_script(cache_dir: Path, helpers: str) -> tuple[int, list[str], list[float]]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(HYBRIDMOE_CACHE_DIR=str(cache_dir), HYBRIDMOE_COMPILE_HELPERS=helpers)
    command = [sys.executable, "-c", SCRIPT]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_second_kind_compiles_in_a_helper_and_loads_from_the_cache(tmp_path):
    elsewhere, names, errors = run_script(tmp_path, helpers="1")
    assert elsewhere == 1
    # this process compiled the f32 kind's entry point, not the bf16 one's (the helper did)
    assert "fused_moe_f32" in names and "fused_moe_bf16" not in names, names
    assert max(errors) < 1e-4, errors
    elsewhere, names, errors = run_script(tmp_path, helpers="1")  # all in the cache now
    assert (elsewhere, names) == (0, []) and max(errors) < 1e-4


def small_bank(dtype: torch.dtype) -> ExpertBank:
    g = torch.Generator().manual_seed(1)
    return ExpertBank(
        torch.randn(2, 64, 32, generator=g).to(dtype), torch.randn(2, 32, 32, generator=g).to(dtype)
    )


def test_no_helper_starts_for_kernels_in_the_cache():
    banks = [small_bank(torch.float32), small_bank(torch.bfloat16)]
    for bank in banks:  # compiled, or loaded, here: in the cache either way
        fused_cpu_moe(torch.ones(1, 32), torch.tensor([[0]]), torch.zeros(1, 1), bank)
    for bank in banks:
        formats, sig = kernel_signature(bank)
        assert compile_helpers.is_cached(kernel_entry(formats), sig)
    assert compile_helpers.start_missing(banks).processes == []


def test_a_cache_that_cannot_be_read_counts_as_cached():
    """numba's internals changed: no helper, the caller compiles as before."""
    assert compile_helpers.is_cached(object(), ())


@pytest.mark.parametrize(("value", "limit"), [("0", 0), ("3", 3), ("", None)])
def test_the_helper_limit(monkeypatch, value, limit):
    monkeypatch.setenv(compile_helpers.HELPERS_ENV, value)
    cores = len(os.sched_getaffinity(0))
    assert compile_helpers.helper_limit() == (cores - 1 if limit is None else limit)


def test_a_bad_helper_limit_names_the_variable(monkeypatch):
    monkeypatch.setenv(compile_helpers.HELPERS_ENV, "two")
    with pytest.raises(ValueError, match="HYBRIDMOE_COMPILE_HELPERS"):
        compile_helpers.helper_limit()


def test_a_helper_of_another_cache_directory_compiles_nothing():
    formats, sig = kernel_signature(small_bank(torch.float32))
    payload = pickle.dumps((formats, sig, "/nonexistent/other-cache"))
    command = [sys.executable, "-m", "hybridmoe.moe.compile_helpers"]
    done = subprocess.run(command, input=payload, capture_output=True, timeout=300)
    assert done.returncode == 3, done.stderr


def test_a_failing_caller_stops_its_helpers(monkeypatch):
    """An error (or Ctrl-C) while the caller compiles its own kind ends the helpers at once
    instead of waiting for their compiles."""
    from hybridmoe.moe import cpu_executor

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    started = compile_helpers.Helpers(banks=[small_bank(torch.bfloat16)], processes=[sleeper])
    monkeypatch.setattr(compile_helpers, "start_missing", lambda banks: started)

    def failing(*args):
        raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            cpu_executor._compile_kernels(failing, [small_bank(torch.float32)])
        assert sleeper.poll() is not None  # terminated and reaped
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
