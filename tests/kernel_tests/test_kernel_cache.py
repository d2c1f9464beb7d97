"""A damaged on-disk cache of compiled CPU kernels is treated as missing: the kernel is
recompiled (and the cache rewritten) instead of every run failing."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numba
import pytest
from numba.core import types
from numba.core.registry import cpu_target

from hybridmoe.kernels.numba_cache import RebuildingFunctionCache, index_lock

# Computes one fused layer with the numba kernel and the torch reference; prints the largest
# difference. A fresh process, so the kernel comes from the cache directory or a compile.
SCRIPT = """
import torch
from hybridmoe.moe.cpu_experts import bank_moe, fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank
g = torch.Generator().manual_seed(0)
bank = ExpertBank(torch.randn(4, 64, 32, generator=g), torch.randn(4, 32, 32, generator=g))
ids = torch.tensor([[0, 2], [3, 1]])
weights = torch.rand(2, 2, generator=g)
x = torch.randn(2, 32, generator=g)
print((fused_cpu_moe(x, ids, weights, bank) - bank_moe(x, ids, weights, bank)).abs().max().item())
"""


def run_kernel(cache_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["HYBRIDMOE_CACHE_DIR"] = str(cache_dir)
    command = [sys.executable, "-c", SCRIPT]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)


def damage(cached: list[Path]) -> None:
    """Half the kernels get a truncated index, the other half data files of garbage (behind a
    good index): numba fails in _load_index for the first, in _load_data for the second."""
    indexes = [p for p in cached if p.suffix == ".nbi"]
    for i, index in enumerate(indexes):
        if i % 2 == 0:
            index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
            continue
        for data in index.parent.glob(index.stem + ".*.nbc"):
            data.write_bytes(b"\x80garbage" * 9)


def test_a_damaged_kernel_cache_is_rebuilt(tmp_path):
    first = run_kernel(tmp_path)
    assert first.returncode == 0, first.stderr
    cached = sorted(tmp_path.rglob("*.nb[ic]"))
    assert any(p.suffix == ".nbi" for p in cached) and any(p.suffix == ".nbc" for p in cached)
    damage(cached)
    second = run_kernel(tmp_path)
    assert second.returncode == 0, second.stderr
    assert float(second.stdout) < 1e-4, second.stdout
    assert "recompiling" in second.stderr  # said, not silent
    third = run_kernel(tmp_path)  # the rewritten cache loads cleanly
    assert third.returncode == 0 and "recompiling" not in third.stderr, third.stderr


# --- saves and loads of one function's entries exclude each other ----------------------------

MODULE = """
from hybridmoe.kernels.numba_cache import cached_njit


@cached_njit()
def plus_one(x):
    return x + 1
"""
WAIT_S = 10.0  # upper bound on any wait; only reached when the code under test is broken


@pytest.fixture
def two_overloads(tmp_path, monkeypatch):
    """(function, [(signature, compile result)] * 2): `plus_one` of a module written here,
    compiled for int64 and float64 with its cache directory emptied afterwards, so that the
    test's caches save them anew."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "cache_race_module.py").write_text(MODULE)
    cache_dir = tmp_path / "cache"
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(cache_dir))
    module = importlib.import_module("cache_race_module")
    monkeypatch.setitem(sys.modules, "cache_race_module", module)
    function = module.plus_one
    overloads = []
    for sig in ((types.int64,), (types.float64,)):
        function.compile(sig)
        overloads.append((sig, function.overloads[sig]))
    shutil.rmtree(cache_dir)
    return function, overloads


def pause_saving_data(cache: RebuildingFunctionCache) -> tuple[threading.Event, threading.Event]:
    """(inside, go): `cache`'s next save stops after writing its index, sets `inside`, and
    writes its data file once `go` is set."""
    inside, go = threading.Event(), threading.Event()
    save_data = cache._cache_file._save_data

    def paused(name, data):
        inside.set()
        if not go.wait(WAIT_S):
            raise AssertionError("the test never let the save go on")
        save_data(name, data)

    cache._cache_file._save_data = paused
    return inside, go


def test_a_save_waits_for_another_processs_save_of_the_same_function(two_overloads):
    """The race numba leaves open (numba_cache's docstring): a second save, or a load, of the
    same function while a first save is between its index and data writes must wait for it,
    and each signature must then load its own code."""
    function, [(sig_a, cres_a), (sig_b, cres_b)] = two_overloads
    first, second, reader = (RebuildingFunctionCache(function.py_func) for _ in range(3))
    inside, go = pause_saving_data(first)
    saving_a = threading.Thread(target=first.save_overload, args=(sig_a, cres_a))
    saving_a.start()
    assert inside.wait(WAIT_S)
    saving_b = threading.Thread(target=second.save_overload, args=(sig_b, cres_b))
    loaded = []
    loading_a = threading.Thread(
        target=lambda: loaded.append(reader.load_overload(sig_a, cpu_target.target_context))
    )
    saving_b.start()
    loading_a.start()
    saving_b.join(0.5)  # unlocked, a save of one small overload takes milliseconds
    blocked = saving_b.is_alive() and loading_a.is_alive()
    go.set()
    for thread in (saving_a, saving_b, loading_a):
        thread.join(WAIT_S)
        assert not thread.is_alive()
    assert blocked, "a save or a load went on while another save was writing"
    assert loaded[0] is not None and loaded[0].signature.args == sig_a
    for sig in (sig_a, sig_b):
        fresh = RebuildingFunctionCache(function.py_func)
        assert fresh.load_overload(sig, cpu_target.target_context).signature.args == sig


def test_the_index_lock_runs_unlocked_where_no_lock_file_can_be_made(tmp_path):
    """A cache directory where nothing can be written (here: below a file) is no error: the
    block runs, unlocked."""
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    ran = []
    with index_lock(str(not_a_directory / "cache" / "f.nbi"), exclusive=True):
        ran.append(True)
    assert ran == [True] and not_a_directory.read_text() == ""
