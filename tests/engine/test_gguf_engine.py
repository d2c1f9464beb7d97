"""A GGUF model as a user runs it: the demo checkpoint converted to GGUF (Q8_0 experts, its
tokenizer and chat template) generates, through the CLI, the text the safetensors demo does
with --expert-format q8_0; its experts' down projections are the file's mapped pages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from gguf_checkpoints import write_gguf
from hybridmoe.models.loading import load_model

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def demo_gguf(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = json.loads((demo_checkpoint / "tokenizer.json").read_text())
    template = json.loads((demo_checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    path = tmp_path_factory.mktemp("demo-gguf") / "demo-Q8_0.gguf"
    return write_gguf(
        demo_checkpoint,
        path,
        "Q8_0",
        tokenizer={**tokenizer, "pre": "gpt-2"},
        chat_template=template,
    )


def _generate(model: Path, *flags: str) -> str:
    args = [sys.executable, "-m", "hybridmoe", "generate", PROMPT, "--max-tokens", "12"]
    run = subprocess.run(
        [*args, "--model", str(model), *flags], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_cli_generates_from_gguf_what_safetensors_gives(demo_checkpoint, demo_gguf) -> None:
    flags = ("--decode-target", "hybrid", "--dtype", "float32")
    expected = _generate(demo_checkpoint, *flags, "--expert-format", "q8_0")
    assert _generate(demo_gguf, *flags) == expected
    assert _generate(demo_gguf.parent, *flags, "--gguf-file", "Q8_0") == expected


def test_expert_banks_are_views_of_the_file(demo_gguf: Path) -> None:
    """bank.gate, .up and .down lie inside a mapping of the GGUF file: no copy of the experts."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps")
    model = load_model(demo_gguf)
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(demo_gguf)):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((start, end))
    assert ranges, "the GGUF file is not mapped"

    def mapped(address: int) -> bool:
        return any(start <= address < end for start, end in ranges)

    for layer in model.moe_layers:
        bank = layer.experts.store
        assert not bank.stacked  # gate and up as the file holds them
        assert all(mapped(t.data_ptr()) for t in (bank.gate, bank.up, bank.down))


def bf16_dense(base: str, value: np.ndarray) -> tuple[np.ndarray, QType] | None:
    """Every dense matrix BF16 but the router's (F32 at every file type, as llama.cpp's
    converter writes it); norms stay F32."""
    if value.ndim != 2 or base.endswith("mlp.gate"):
        return None
    return gguf.quants.quantize(value, QType.BF16), QType.BF16


def test_a_bf16_gguf_decodes_in_bfloat16_by_default(demo_checkpoint, tmp_path) -> None:
    """`--dtype auto` reads a GGUF whose matrices are BF16 as a bf16 checkpoint: the text of
    `--dtype bfloat16`, which is the safetensors checkpoint's in bfloat16 (the same rounded
    weights), not float32's."""
    tokenizer = json.loads((demo_checkpoint / "tokenizer.json").read_text())
    path = write_gguf(
        demo_checkpoint,
        tmp_path / "demo-bf16.gguf",
        "Q8_0",
        tokenizer={**tokenizer, "pre": "gpt-2"},
        dense=bf16_dense,
    )
    assert load_model(path, dtype=None).dtype == torch.bfloat16  # auto
    assert load_model(demo_checkpoint, dtype=None).dtype == torch.float32  # a float32 checkpoint's
    by_default = _generate(path)
    assert by_default == _generate(path, "--dtype", "bfloat16")
    assert by_default == _generate(
        demo_checkpoint, "--dtype", "bfloat16", "--expert-format", "q8_0"
    )
