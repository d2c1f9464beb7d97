"""Host expert banks hold the only resident copy of the experts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BANK_RSS_SCRIPT = """
import re, sys
import torch
from hybridmoe.moe.cpu_experts import fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank
# numba's libraries and the float32 kernel are loaded (and so mapped) alike for every target:
# the hybrid target's CPU executor loads that kernel while it is built, the gpu target's not
fused_cpu_moe(torch.ones(1, 8), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1),
              ExpertBank(torch.ones(1, 8, 8), torch.ones(1, 8, 4)))
from hybridmoe.engine import Engine, EngineConfig
from hybridmoe.moe.config import OffloadConfig

def rss(kind):
    status = open("/proc/self/status").read()
    return int(re.search(kind + r":\\s+(\\d+) kB", status).group(1)) * 1024

offload = OffloadConfig(decode_target=sys.argv[2])
engine = Engine.from_pretrained(sys.argv[1], EngineConfig(dtype="float32", offload=offload))
bank_bytes = sum(b.gate_up.nbytes + b.down.nbytes for b in engine.moe_runtime.banks)
print(rss("RssFile"), rss("RssAnon"), bank_bytes)
"""


def _measure(checkpoint: Path, target: str) -> tuple[int, int, int]:
    result = subprocess.run(
        [sys.executable, "-c", BANK_RSS_SCRIPT, str(checkpoint), target],
        capture_output=True,
        text=True,
        check=True,
    )
    file_bytes, anon_bytes, bank_bytes = map(int, result.stdout.split())
    return file_bytes, anon_bytes, bank_bytes


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_banks_release_the_mapped_expert_pages(aligned_demo_checkpoint: Path) -> None:
    # aligned: the loader maps those experts rather than copying them (see loader.weights.aligned)
    gpu_file, gpu_anon, _ = _measure(aligned_demo_checkpoint, "gpu")
    file_bytes, anon_bytes, bank_bytes = _measure(aligned_demo_checkpoint, "hybrid")
    assert bank_bytes > 0
    assert anon_bytes - gpu_anon > 0.8 * bank_bytes  # the bank really is a copy
    # ...and the copied-from file pages are no longer resident, so experts are held once
    assert file_bytes - gpu_file < 0.25 * bank_bytes, (
        f"RssFile grew by {file_bytes - gpu_file} bytes with {bank_bytes} bytes of banks"
    )


def test_a_bank_in_its_own_pages_shares_no_page_and_keeps_its_values() -> None:
    import mmap

    import torch

    from hybridmoe.quant.bank import ExpertBank

    bank = ExpertBank(torch.randn(3, 10, 7), torch.randn(3, 7, 5))  # sizes not page multiples
    owned = bank.in_own_pages()
    page = mmap.PAGESIZE
    for before, after in ((bank.gate_up, owned.gate_up), (bank.down, owned.down)):
        assert torch.equal(before, after) and after.data_ptr() % page == 0
        storage = after.untyped_storage()  # the pages up to the next boundary are this tensor's
        end = after.data_ptr() + after.nbytes
        assert storage.data_ptr() + storage.nbytes() >= -(-end // page) * page
