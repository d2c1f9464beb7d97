"""The embedded demo checkpoint: a small Qwen3-MoE trained by scripts/train_demo_model.py on the
Python standard library's source, shipped inside the package (Hugging Face layout)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from hybridmoe.errors import CheckpointError

DEMO_VERSION = "v2"
DEMO_MODEL_NAME = f"demo-qwen3moe-{DEMO_VERSION}"  # also the server's model id: the dir's name
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def demo_checkpoint_dir() -> Path:
    """The shipped checkpoint's directory (read-only: it is part of the installed package)."""
    return Path(str(resources.files(__name__) / DEMO_MODEL_NAME))


def require_demo_checkpoint() -> Path:
    """demo_checkpoint_dir(), or CheckpointError naming the files an incomplete install lacks."""
    directory = demo_checkpoint_dir()
    missing = [name for name in CHECKPOINT_FILES if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(
            f"the embedded demo checkpoint {directory} lacks {', '.join(missing)}; reinstall "
            "hybridmoe, or rebuild it with scripts/train_demo_model.py"
        )
    return directory
