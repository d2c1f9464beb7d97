"""load_model: a Hugging Face checkpoint directory into the model its family builds."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.checkpoint import check_all_used, refuse_quantized, stored_dtype
from hybridmoe.loader.files import read_json_object
from hybridmoe.loader.weights import WeightSource
from hybridmoe.models.registry import family_for


def load_model(
    directory: str | Path, dtype: torch.dtype | None = torch.float32, progress: bool = False
):
    """MoeCausalLM of the checkpoint in `directory`, weights memory-mapped where dtypes agree.
    `dtype` None picks it from config.json (see stored_dtype)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    config_path = directory / "config.json"
    raw = read_json_object(config_path)
    refuse_quantized(raw, config_path)
    family = family_for(raw, str(config_path))
    cfg = family.config_from(raw, str(config_path))
    source = WeightSource.from_dir(directory, dtype or stored_dtype(raw), progress)
    try:
        model = family.build(cfg, family, source)
        check_all_used(source, config_path)
        return model
    finally:
        source.close()
