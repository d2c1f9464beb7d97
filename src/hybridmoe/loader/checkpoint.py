"""Loading a Hugging Face checkpoint directory into a MoeCausalLM."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.files import read_json_object
from hybridmoe.loader.weights import WeightSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def stored_dtype(raw_config: dict) -> torch.dtype:
    """The `auto` dtype: bfloat16 for a bf16 checkpoint, float32 otherwise (CPU fp16 is slow)."""
    stored = raw_config.get("dtype") or raw_config.get("torch_dtype")
    return torch.bfloat16 if stored == "bfloat16" else torch.float32


def load_model(
    directory: str | Path, dtype: torch.dtype | None = torch.float32, progress: bool = False
):
    """MoeCausalLM of the checkpoint in `directory`, weights memory-mapped where dtypes agree.
    `dtype` None picks it from config.json (see stored_dtype)."""
    from hybridmoe.models.config import HfConfigReader
    from hybridmoe.models.registry import family_for
    from hybridmoe.models.transformer import MoeCausalLM

    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    config_path = directory / "config.json"
    raw = read_json_object(config_path)
    family = family_for(raw, str(config_path))
    cfg = family.parse_config(HfConfigReader(raw, str(config_path)))
    source = WeightSource.from_dir(directory, dtype or stored_dtype(raw), progress)
    try:
        return MoeCausalLM(cfg, family, source)
    finally:
        source.close()
