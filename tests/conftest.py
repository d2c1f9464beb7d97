"""Fixtures shared by every test folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from hybridmoe import env
from hybridmoe.demo import DEMO_MODEL_NAME, require_demo_checkpoint
from safetensors_layout import write_safetensors

# `--device auto` means cpu in this suite, on a GPU machine too (and in the servers it starts):
# the suite tests the cpu tier; tests/gpu names its device explicitly.
os.environ.setdefault("HYBRIDMOE_AUTO_DEVICE", "cpu")
# transformers >= 5.25 kernelizes models with Hugging Face hub kernels by default (from_pretrained
# then demands the `kernels` package); the references here are transformers' own modules
os.environ.setdefault("USE_HUB_KERNELS", "0")
WARM_SHARDS_MAX = 8


@pytest.fixture(autouse=True)
def _switches_read_again() -> Iterator[None]:
    """After every test (and its monkeypatch's undo, set up later: torn down first), the
    switches hybridmoe/env.py reads once read the environment again, so one that a test set
    does not outlive it."""
    yield
    env.reread_switches()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--warm-kernels",
        action="store_true",
        help="before any test, compile the numba kernels most tests call into the kernel cache, "
        "split across the cores (tests/warm_kernels.py): pytest-xdist workers otherwise each "
        "compile every one of them cold, at about the same time",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    """--warm-kernels: tests/warm_kernels.py in one process a core, waited for, in the main
    process only (pytest-xdist starts its workers after this hook: trylast)."""
    config = session.config
    if not config.getoption("--warm-kernels") or hasattr(config, "workerinput"):
        return
    shards = max(1, min(os.cpu_count() or 1, WARM_SHARDS_MAX))
    script = str(Path(__file__).with_name("warm_kernels.py"))
    start = time.monotonic()
    logs = [tempfile.TemporaryFile("w+") for _ in range(shards)]  # a pipe could fill and block
    runs = [
        subprocess.Popen([sys.executable, script, str(i), str(shards)], stdout=log, stderr=log)
        for i, log in enumerate(logs)
    ]
    report = config.pluginmanager.get_plugin("terminalreporter")
    for i, (run, log) in enumerate(zip(runs, logs, strict=True)):
        if run.wait() != 0 and report is not None:  # the tests that call it fail too
            log.seek(0)
            report.write_line(f"--warm-kernels shard {i} failed ({run.returncode}):\n{log.read()}")
        log.close()
    if report is not None:
        seconds = time.monotonic() - start
        report.write_line(f"--warm-kernels: {shards} processes, {seconds:.0f} s")


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the embedded demo checkpoint (fp32, ~17 MB), made once per session so no test
    can touch the package's files. Tests must not modify it; `demo_variant` makes modified
    copies."""
    directory = tmp_path_factory.mktemp("demo-checkpoint") / DEMO_MODEL_NAME
    shutil.copytree(require_demo_checkpoint(), directory)
    return directory


@pytest.fixture(scope="session")
def aligned_demo_checkpoint(
    demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The demo with model.safetensors rewritten so that every tensor starts at a multiple of
    64 bytes in the file, which the loader maps without copying (the demo's own file places
    them at 16 mod 64, so the loader copies them): for tests that measure the mapping."""
    directory = tmp_path_factory.mktemp("aligned-demo") / DEMO_MODEL_NAME
    shutil.copytree(demo_checkpoint, directory, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(str(demo_checkpoint / "model.safetensors"))
    write_safetensors(directory / "model.safetensors", dict(sorted(weights.items())))
    return directory


@pytest.fixture
def demo_variant(demo_checkpoint: Path, tmp_path: Path) -> Callable[..., Path]:
    """`make(config_changes, drop_fields, skip)`: a new checkpoint directory whose files are
    symlinks to the demo's, except those named in `skip` (left out) and config.json when
    `config_changes` or `drop_fields` are given (rewritten with the changes, without the dropped
    fields). Cheap: nothing is copied."""
    made = 0

    def make(
        config_changes: dict[str, Any] | None = None,
        drop_fields: tuple[str, ...] = (),
        skip: tuple[str, ...] = (),
    ) -> Path:
        nonlocal made
        made += 1
        directory = tmp_path / f"variant-{made}"
        directory.mkdir()
        new_config = config_changes is not None or bool(drop_fields)
        if new_config:
            skip = (*skip, "config.json")
        for path in demo_checkpoint.iterdir():
            if path.name not in skip:
                (directory / path.name).symlink_to(path)
        if new_config:
            config = json.loads((demo_checkpoint / "config.json").read_text())
            config.update(config_changes or {})
            config = {k: v for k, v in config.items() if k not in drop_fields}
            (directory / "config.json").write_text(json.dumps(config))
        return directory

    return make


@pytest.fixture
def attention_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sequences each call of the CPU decode-attention kernel (kernels/numba_attention.py,
    alone or inside the attention block: kernels/attention_block.py) took, appended as the
    test's steps call it (to see that they do)."""
    from hybridmoe.kernels import attention_block, numba_attention

    calls, kernel, block = [], numba_attention.decode_attention, attention_block._run

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return kernel(q, *args, **kwargs)

    def counting_block(qkv, o, q_norm, k_norm, eps, x, *args, **kwargs):  # inside the block
        calls.append(x.shape[0])
        return block(qkv, o, q_norm, k_norm, eps, x, *args, **kwargs)

    monkeypatch.setattr(numba_attention, "decode_attention", counting)
    monkeypatch.setattr(attention_block, "_run", counting_block)
    return calls
