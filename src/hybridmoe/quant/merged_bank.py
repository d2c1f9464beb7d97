"""A layer's expert bank from a file that stores its experts merged (GGUF's
`blk.N.ffn_{gate,up,down}_exps`): the file's bytes in the file's format, never converted.

`_bank_of` is the one place such a bank is assembled from the three merged tensors.
"""

from __future__ import annotations

import torch

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.weights import MergedExperts, WeightSource, aligned
from hybridmoe.quant.bank import ExpertBank, ExpertWeights
from hybridmoe.quant.expert_math import SILU, ExpertActivation, ExpertBiases
from hybridmoe.quant.formats import WEIGHT_FORMATS, WeightFormat


def load_experts(
    source: WeightSource, prefix: str, shape: tuple[int, int, int], names: tuple[str, str, str]
) -> ExpertWeights | ExpertBank:
    """A layer's routed experts `prefix`.*: the file's merged bank where the source stores
    them merged (GGUF), else the per-expert matrices. shape = (E, H, I)."""
    merged = source.merged_experts(prefix, names)
    if merged is None:
        return ExpertWeights.load(source, prefix, shape, names)
    return bank_from_merged(merged, shape)


def bank_from_merged(
    merged: MergedExperts,
    shape: tuple[int, int, int],
    biases: ExpertBiases | None = None,
    activation: ExpertActivation = SILU,
) -> ExpertBank:
    """A bank over a file's merged experts (shape = (E, H, I)) in the file's formats, each a
    registered weight format (experts are never converted at load): gate and up in one
    format (they are computed side by side), down in its own; with the family's expert
    `biases` and `activation` (gpt-oss's), if any."""
    gate_type, up_type, down_type = merged.type_names
    if gate_type != up_type:
        raise CheckpointError(
            f"{merged.path}: tensor '{merged.names[0]}' is {gate_type} but '{merged.names[1]}' "
            f"is {up_type}; a layer's expert gate and up must share one type"
        )
    gate_up_fmt = merged_format(merged, 0)
    down_fmt = merged_format(merged, 2)
    num, hidden, inter = shape
    gate, up = (
        _stored_as(t, gate_up_fmt, (num, inter, hidden), name)
        for t, name in zip((merged.gate, merged.up), merged.names[:2], strict=True)
    )
    down = _stored_as(merged.down, down_fmt, (num, hidden, inter), merged.names[2])
    return _bank_of(gate, up, down, gate_up_fmt, down_fmt, biases, activation)


def merged_format(merged: MergedExperts, index: int) -> WeightFormat:
    """The registered format named like the type of the file's tensor `index` (0 gate, 1 up,
    2 down; GGUF names, lower case); CheckpointError naming the tensor and its type when
    there is none."""
    type_name = merged.type_names[index]
    fmt = WEIGHT_FORMATS.get(type_name.lower())
    if fmt is None:
        raise CheckpointError(
            f"{merged.path}: tensor '{merged.names[index]}' has type {type_name}, which no "
            f"expert weight format stores (supported: "
            f"{', '.join(f.upper() for f in WEIGHT_FORMATS)}); experts are not converted at load"
        )
    return fmt


def _stored_as(
    data: torch.Tensor, fmt: WeightFormat, shape: tuple[int, int, int], name: str
) -> torch.Tensor:
    """The file's bytes of a weight of float `shape` as `fmt` stores it (no copy)."""
    stored_shape = fmt.stored_shape(shape)
    raw = data.view(torch.uint8)
    if raw.numel() != fmt.row_bytes(shape[-1]) * shape[0] * shape[1]:
        raise CheckpointError(
            f"tensor '{name}' holds {raw.numel()} bytes; experts of shape {shape} in "
            f"{fmt.name} take {fmt.row_bytes(shape[-1]) * shape[0] * shape[1]}"
        )
    return raw.reshape(-1).view(fmt.storage_dtype).reshape(stored_shape)


def _bank_of(
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    gate_up_fmt: WeightFormat,
    down_fmt: WeightFormat,
    biases: ExpertBiases | None = None,
    activation: ExpertActivation = SILU,
) -> ExpertBank:
    """The one place a file's bank is assembled from its three merged tensors: views of the
    mapping, no copy. A dense (f32/bf16/f16) tensor not 64-byte aligned in the file is copied
    (`aligned`: torch's GEMMs may round by address); block formats are read by kernels whose
    result does not depend on where a row starts, so they stay views wherever they lie."""
    if not gate_up_fmt.is_quantized:
        gate, up = aligned(gate), aligned(up)
    if not down_fmt.is_quantized:
        down = aligned(down)
    return ExpertBank(
        gate=gate,
        up=up,
        down=down,
        fmt=gate_up_fmt,
        down_fmt=down_fmt,
        biases=biases,
        activation=activation,
    )
