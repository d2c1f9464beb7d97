"""load_model: a checkpoint (a Hugging Face directory, or a GGUF file) into the model its
family builds."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.config.model import ModelConfig
from hybridmoe.errors import CheckpointError
from hybridmoe.loader.checkpoint import check_all_used, refuse_quantized, stored_dtype
from hybridmoe.loader.files import read_json_object
from hybridmoe.loader.gguf import GgufFile, is_gguf
from hybridmoe.loader.gguf_tokenizer import gguf_tokenizer
from hybridmoe.loader.gguf_weights import GgufWeightSource
from hybridmoe.loader.tokenizer import TOKENIZER_FILE, Tokenizer
from hybridmoe.loader.weights import WeightSource
from hybridmoe.models.gguf_config import GgufKeys, nextn_prefixes
from hybridmoe.models.gguf_names import gguf_name_map
from hybridmoe.models.registry import ModelFamily, family_for, family_for_gguf
from hybridmoe.models.transformer import MoeCausalLM


def load_model(
    path: str | Path, dtype: torch.dtype | None = torch.float32, progress: bool = False
) -> MoeCausalLM:
    """MoeCausalLM of the checkpoint at `path` (see load_hf_model and load_gguf_model)."""
    path = Path(path)
    if is_gguf(path):
        return load_gguf_model(GgufFile(path), dtype, progress)
    return load_hf_model(path, dtype, progress)


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype | None = torch.float32,
    progress: bool = False,
    huge_pages: str = "none",
) -> tuple[MoeCausalLM, Tokenizer | None]:
    """The model and the tokenizer of the checkpoint at `path`: a GGUF's own, or a Hugging Face
    directory's tokenizer.json (None without one). `huge_pages`: what of a GGUF's mapping is
    moved onto transparent huge pages first (GgufFile's modes); "all" (--huge-pages) is a
    CheckpointError for another checkpoint."""
    path = Path(path)
    if is_gguf(path):
        gguf = GgufFile(path, huge_pages, progress)
        return load_gguf_model(gguf, dtype, progress), gguf_tokenizer(gguf)
    if huge_pages == "all":
        raise CheckpointError(
            f"{path}: --huge-pages applies to GGUF files; this is a Hugging Face checkpoint"
        )
    model = load_hf_model(path, dtype, progress)
    return model, Tokenizer.from_dir(path) if (path / TOKENIZER_FILE).exists() else None


def load_hf_model(
    directory: str | Path, dtype: torch.dtype | None = torch.float32, progress: bool = False
):
    """MoeCausalLM of the Hugging Face checkpoint in `directory`, weights memory-mapped where
    dtypes agree. `dtype` None picks it from config.json (see stored_dtype)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    config_path = directory / "config.json"
    raw = read_json_object(config_path)
    family = family_for(raw, str(config_path))
    refuse_quantized(raw, config_path, family.quant_methods)
    cfg = family.config_from(raw, str(config_path))
    source = WeightSource.from_dir(directory, dtype or stored_dtype(raw), progress)
    return _build(family, cfg, source, config_path)


def load_gguf_model(
    gguf: GgufFile, dtype: torch.dtype | None = torch.float32, progress: bool = False
):
    """MoeCausalLM of a GGUF model: config from its metadata, dense weights dequantised to
    `dtype` (None: gguf_stored_dtype), routed experts kept in the file's format,
    memory-mapped."""
    family, cfg = gguf_family_config(gguf)
    restore = family.gguf.restore(cfg) if family.gguf.restore is not None else None
    if family.gguf.names is not None:
        names = family.gguf.names(cfg)
    else:
        weights = family.weights
        names = gguf_name_map(
            weights.moe_prefix, weights.expert_names, weights.router, dict(family.gguf.layer_names)
        )
    source = GgufWeightSource(gguf, dtype or gguf_stored_dtype(gguf), names, restore, progress)
    return _build(family, cfg, source, gguf.path, nextn_prefixes(GgufKeys(gguf)))


def gguf_stored_dtype(gguf: GgufFile) -> torch.dtype:
    """The `auto` dtype of a GGUF model, as stored_dtype's of a checkpoint: bfloat16 when its
    matrices other than the routers' (`ffn_gate_inp*`, which llama.cpp's converter keeps in
    F32 at every file type) are all BF16, the dense ones then read as stored; float32
    otherwise (quantised or F16/F32 dense matrices: llama.cpp's float32 activations)."""
    types = {
        tensor.type_name
        for name, tensor in gguf.tensors.items()
        if len(tensor.shape) == 2 and "ffn_gate_inp" not in name
    }
    return torch.bfloat16 if types == {"BF16"} else torch.float32


def gguf_family_config(gguf: GgufFile) -> tuple[ModelFamily, ModelConfig]:
    """The family of a GGUF model and its ModelConfig, from the metadata alone."""
    family = family_for_gguf(gguf.architecture, str(gguf.path))
    where = f"{gguf.path} (metadata as config.json fields)"
    return family, family.config_from(family.gguf.config(gguf), where)


def _build(family, cfg, source, origin: Path, unread_prefixes: tuple[str, ...] = ()):
    """The model; `unread_prefixes`: tensors left unread besides the family's ignored ones."""
    try:
        model = family.build(cfg, family, source)
        check_all_used(source, origin, family.weights.ignored_prefixes + unread_prefixes)
        return model
    finally:
        source.close()
