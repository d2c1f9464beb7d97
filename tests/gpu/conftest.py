"""tests/gpu/: checks that need an accelerator (CUDA, or ROCm through the torch.cuda API).

Without one every test here is skipped. HYBRIDMOE_GPU_TESTS_DRY_RUN=1 runs them on the cpu
device instead, except those marked `cuda_only` (streams, events, pinned memory): a dry run
catches mistakes in the tests themselves on a machine without a GPU and proves nothing about
the accelerator. The tests compute in fp32 with TF32 off, so that the device and the cpu
reference differ only in summation order.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_checkpoints import write_hf_checkpoint

DRY_RUN_ENV = "HYBRIDMOE_GPU_TESTS_DRY_RUN"
HERE = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cuda_only: needs a real accelerator (streams, events, pinned memory)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    dry_run = os.environ.get(DRY_RUN_ENV) == "1"
    no_device = pytest.mark.skip(
        reason=f"no CUDA/ROCm device (torch {torch.__version__}: torch.cuda.is_available() is "
        f"False); {DRY_RUN_ENV}=1 runs the device-agnostic tests on the cpu device"
    )
    needs_device = pytest.mark.skip(reason=f"{DRY_RUN_ENV}=1 on the cpu device: needs CUDA")
    for item in items:
        if not item.path.is_relative_to(HERE):  # the hook sees every collected test
            continue
        if not dry_run:
            item.add_marker(no_device)
        elif item.get_closest_marker("cuda_only"):
            item.add_marker(needs_device)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The accelerator; the cpu device in a dry run."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@pytest.fixture(scope="session", autouse=True)
def exact_fp32_matmul() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OLMoE written by `transformers`, fp32: 2 MoE layers x 8 experts, top-3, hidden 64,
    expert width 32 (whole q8_0/q4_0 blocks); greedy-stable after hf_checkpoints.PROMPT_IDS."""
    return write_hf_checkpoint("olmoe", "gqa_clip_qkv", tmp_path_factory.mktemp("olmoe"))
