"""A Hugging Face checkpoint directory's checks that need no model: dtypes, quantisation, unused
tensors (models/loading.py builds the model)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from hybridmoe.errors import CheckpointError, UnsupportedConfigError
from hybridmoe.loader.weights import WeightSource

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Tensors a checkpoint may hold that the model legitimately does not read: rotary inverse
# frequencies that old exporters saved per layer; we derive them from config.json, and
# transformers skips them the same way (`rotary_emb\.inv_freq` in its unexpected-key patterns).
IGNORED_TENSORS = re.compile(r"rotary_emb\.inv_freq$")
SHOWN_UNUSED = 5  # unused tensors named in the error; the rest are counted


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def stored_dtype(raw_config: dict) -> torch.dtype:
    """The `auto` dtype: bfloat16 for a bf16 checkpoint, float32 otherwise (CPU fp16 is slow)."""
    stored = raw_config.get("dtype") or raw_config.get("torch_dtype")
    return torch.bfloat16 if stored == "bfloat16" else torch.float32


def refuse_quantized(raw_config: dict, config_path: Path, readable: tuple[str, ...] = ()) -> None:
    """UnsupportedConfigError for a checkpoint that declares a `quantization_config` (null counts
    as absent, as in transformers) whose `quant_method` is not in `readable` (the methods the
    family loads as stored: gpt-oss's "mxfp4" experts); reading other quantised weights without
    their scales would compute garbage."""
    quantization = raw_config.get("quantization_config")
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method in readable:
        return
    raise UnsupportedConfigError(
        f"{config_path}: field 'quantization_config' (quant_method {method!r}) is not "
        "supported for this model: use an unquantised (bfloat16/float16/float32) checkpoint "
        "of it, or a GGUF file"
    )


def check_all_used(
    source: WeightSource, config_path: Path, ignored_prefixes: tuple[str, ...] = ()
) -> None:
    """CheckpointError naming the tensors the model built from config.json did not read: a
    config that silently drops weights (a missing field, too few layers) runs a different model.
    Tensors under `ignored_prefixes` (parts of the checkpoint that are not the text model: a
    vision tower, multi-token-prediction heads) are left unread, with a one-line notice."""
    unread = [name for name in source.unread_names() if not IGNORED_TENSORS.search(name)]
    skipped = [name for name in unread if name.startswith(ignored_prefixes)]
    if skipped:
        prefixes = sorted({p for p in ignored_prefixes for name in skipped if name.startswith(p)})
        log.info(
            "%s: not loading %d tensors under %s (not part of the text model)",
            config_path, len(skipped), ", ".join(f"'{p}'" for p in prefixes),
        )  # fmt: skip
    unused = [name for name in unread if not name.startswith(ignored_prefixes)]
    if unused:
        shown = ", ".join(unused[:SHOWN_UNUSED])
        more = f" and {len(unused) - SHOWN_UNUSED} more" if len(unused) > SHOWN_UNUSED else ""
        raise CheckpointError(
            f"{config_path} describes a model that does not use {len(unused)} of the "
            f"checkpoint's tensors: {shown}{more}"
        )
