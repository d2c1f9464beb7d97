"""Every tensor the loader hands out is 64-byte aligned, wherever it lies in its file: CPU
kernels sum in an order that depends on the weight's address mod the vector width, so the same
weights at another offset (one file vs shards) would otherwise give different logits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridmoe.loader.weights import ALIGNMENT_BYTES, WeightSource
from safetensors_layout import tensor_offsets_mod_64, write_safetensors


def misaligned_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors whose odd byte sizes put each next one at another offset mod 64, after two
    whose sizes are multiples of 64 (aligned when the data starts aligned)."""
    torch.manual_seed(0)
    shapes = {"a": (4, 32), "b": (64,), "odd": (3,), "c": (5, 7), "d": (9,), "e": (96, 192)}
    return {name: torch.randn(shape).to(dtype) for name, shape in shapes.items()}


def mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file mapping in this process."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            found.append((start, end, fields[5]))
    return found


def in_mapping_of(tensor: torch.Tensor, path: Path) -> bool:
    address = tensor.data_ptr()
    return any(s <= address < e and p == str(path.resolve()) for s, e, p in mapped_files())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("data_start_mod_64", [0, 8, 16])
def test_every_tensor_is_aligned_and_exact(tmp_path, dtype, data_start_mod_64):
    path = tmp_path / "model.safetensors"
    tensors = misaligned_tensors(dtype)
    write_safetensors(path, tensors, data_start_mod_64)
    offsets = tensor_offsets_mod_64(path)
    assert len(set(offsets.values())) >= 4, f"the file should misalign tensors: {offsets}"
    source = WeightSource([path], dtype)
    for name, expected in tensors.items():
        tensor = source.get(name, expected.shape)
        assert tensor.data_ptr() % ALIGNMENT_BYTES == 0, f"{name} at {offsets[name]} mod 64"
        assert tensor.dtype == dtype and torch.equal(tensor, expected), name


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_only_misaligned_tensors_are_copied(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = misaligned_tensors(torch.float32)
    write_safetensors(path, tensors, data_start_mod_64=0)
    source = WeightSource([path], torch.float32)
    for name, offset in tensor_offsets_mod_64(path).items():
        tensor = source.get(name, tensors[name].shape)
        assert in_mapping_of(tensor, path) == (offset == 0), f"{name} at {offset} mod 64"


# The sharded-vs-single-file exactness test in a process whose MKL takes its SSE4.2 code path,
# where sgemv's result depends on the weight's address mod 16: without aligned weights the
# logits differ by ~1e-5 there on any x86-64 machine, as they did on an AMD EPYC's own path.
SSE_PATH_ENV = {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}


def without_pytest_options(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name != "PYTEST_ADDOPTS"}


def test_sharded_logits_exact_on_an_alignment_sensitive_kernel():
    test = Path(__file__).with_name("test_loader_errors.py")
    node = f"{test}::test_sharded_checkpoint_gives_identical_logits"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
        capture_output=True,
        text=True,
        env={**without_pytest_options(os.environ), **SSE_PATH_ENV},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
