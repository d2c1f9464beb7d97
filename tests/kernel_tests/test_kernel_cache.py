"""A damaged on-disk cache of compiled CPU kernels is treated as missing: the kernel is
recompiled (and the cache rewritten) instead of every run failing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
