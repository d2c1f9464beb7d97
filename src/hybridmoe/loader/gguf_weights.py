"""GgufWeightSource: a GGUF model's tensors under the checkpoint names the model builder reads.

The family's name map turns a Hugging Face name (`model.layers.3.self_attn.q_proj.weight`)
into the GGUF one (`blk.3.attn_q.weight`); `get` returns that tensor dequantised to the compute
dtype (dense weights: norms, embeddings, routers, and the projections below), after the
family's `restore` undoes what llama.cpp's converter changed (the rotary row permutation of
llama-arch q/k). Routed experts are not dequantised: `merged_experts` hands the layer's three
merged tensors over in the file's format, as views of the mapping; nor are quantised dense
projections (attention, dense MLPs, shared experts, the output head), which
`stored_projection` hands over the same way where the family's restore leaves them as stored
or only reorders their rows (`RowRestore`: llama-arch q/k, their quantised rows reordered as
bytes; Qwen3-Next's restore rewrites norms and its linear attention's tensors, not these).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.gguf import GgufFile, GgufTensor
from hybridmoe.loader.weights import MergedExperts, aligned

# checkpoint name -> GGUF tensor name, or None where the file has no counterpart for it; or
# several names, for a checkpoint tensor the converter split into parts along its rows (their
# concatenation: Qwen3-Next's in_proj_qkvz, stored as attn_qkv and attn_gate)
GgufNameMap = Callable[[str], "str | tuple[str, ...] | None"]
# (checkpoint name, dequantised float32 tensor) -> the tensor as the checkpoint held it
Restore = Callable[[str, torch.Tensor], torch.Tensor]


class RowRestore:
    """A Restore that says per tensor what it does: `order(name, rows)` gives the checkpoint's
    row order of tensor `name` as indices into the file's rows (restored = stored[order]),
    None for a tensor it leaves as stored, or REWRITTEN for one whose values `values(name,
    tensor)` rewrites. A row is a projection's output, whole in any weight format, so
    stored_projection keeps a quantised projection in the file's type where its rows are
    reordered or left (llama-arch q/k, whose rows llama.cpp's converter permutes for its
    rotary layout; every projection of a family that rewrites only norms and the like)."""

    def __init__(
        self,
        order: Callable[[str, int], torch.Tensor | str | None],
        values: Restore | None = None,
    ):
        self.order, self.values = order, values

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        order = self.order(name, tensor.shape[0] if tensor.dim() else 0)
        if order is None:
            return tensor
        if isinstance(order, str):  # REWRITTEN
            return self.values(name, tensor)
        return tensor[order]


REWRITTEN = "rewritten"  # RowRestore.order's answer for a tensor whose values it rewrites


# ggml types stored as one float a value: read as torch views, no gguf.quants call
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class GgufWeightSource:
    """The WeightSource interface (loader/weights.py) over a GgufFile."""

    def __init__(
        self,
        gguf: GgufFile,
        dtype: torch.dtype,
        name_map: GgufNameMap,
        restore: Restore | None = None,
        progress: bool = False,
    ):
        self.gguf, self.dtype = gguf, dtype
        self._name_map, self._restore = name_map, restore
        self._read: set[str] = set()
        self._bar = tqdm(
            total=len(gguf.tensors), desc="loading GGUF", unit="tensor", disable=not progress
        )

    def _tensor(self, name: str) -> GgufTensor | None:
        gguf_name = self._name_map(name)
        if gguf_name is None or isinstance(gguf_name, tuple):
            return None
        return self.gguf.tensors.get(gguf_name)

    def _parts(self, name: str) -> list[GgufTensor] | None:
        """The GGUF tensors checkpoint tensor `name` is stored as (one, or the row-wise parts
        of a split one); None if the file lacks any."""
        gguf_names = self._name_map(name)
        if gguf_names is None:
            return None
        found = [self.gguf.tensors.get(n) for n in _as_tuple(gguf_names)]
        return None if None in found else found

    def has(self, name: str) -> bool:
        return self._parts(name) is not None

    def get(self, name: str, shape: Sequence[int], align: bool = True) -> torch.Tensor:
        """The tensor the checkpoint would call `name`, in the source dtype, dequantised;
        CheckpointError if the file lacks it or its shape is not `shape` (GGUF drops
        leading dims of 1: [1, H] and [H] are the same tensor)."""
        parts = self._parts(name)
        if parts is None:
            missing = [n for n in _as_tuple(self._name_map(name)) if n not in self.gguf.tensors]
            raise CheckpointError(
                f"{self.gguf.path}: tensor '{missing[0] if missing else None}' ({name}) is missing"
            )
        rows = sum(_squeezed(t.shape)[0] for t in parts)
        stored = (rows, *_squeezed(parts[0].shape)[1:]) if len(parts) > 1 else parts[0].shape
        if _squeezed(stored) != _squeezed(tuple(shape)):
            shown = " + ".join(f"'{t.name}' {t.shape}" for t in parts)
            raise CheckpointError(
                f"{parts[0].path}: tensor {shown} has shape {stored}, the metadata implies "
                f"{tuple(shape)}"
            )
        for tensor in parts:
            self._mark_read(tensor)
        values = [_dequantized(t, self.dtype).reshape(_squeezed(t.shape)) for t in parts]
        value = (values[0] if len(values) == 1 else torch.cat(values)).reshape(tuple(shape))
        if self._restore is not None:
            value = self._restore(name, value)
        return aligned(value) if align else value

    def stored_projection(
        self, name: str, shape: tuple[int, int]
    ) -> tuple[torch.Tensor, str] | None:
        """Dense projection weight `name` [out, in] as the file stores it, where that is a
        quantised (block) type: (its bytes [out, row bytes], a view of the mapping, the ggml
        type name), marked read; the caller (layers/linear.stored_projection) takes it where
        the type is a weight format whose blocks divide the rows, else reads `get`'s
        dequantised values. None where `get` is the way: a float type, a tensor split in
        parts, a tensor whose values the family's `restore` rewrites (a RowRestore's row order
        is applied here, bytes and all: a copy, not a view; any other Restore: every tensor),
        a shape `get` would refuse."""
        restore = self._restore
        if restore is not None and not isinstance(restore, RowRestore):
            return None
        parts = self._parts(name)
        if parts is None or len(parts) != 1 or parts[0].type_name in _FLOAT_TYPES:
            return None
        tensor = parts[0]
        if tuple(tensor.shape) != tuple(shape) or tensor.data.dim() != 2:
            return None
        data = tensor.data
        order = None if restore is None else restore.order(name, data.shape[0])
        if isinstance(order, str):  # REWRITTEN: its values change, as `get` computes them
            return None
        if order is not None:
            data = data[order]
        self._mark_read(tensor)
        return data, tensor.type_name

    def merged_experts(self, prefix: str, names: tuple[str, str, str]) -> MergedExperts | None:
        """The layer's merged expert tensors, asked for as `prefix`.{gate,up,down name}.weight,
        each in its own type (the bank checks they pair); CheckpointError if any is missing."""
        found = [self._tensor(f"{prefix}.{n}.weight") for n in names]
        gguf_names = [self._name_map(f"{prefix}.{n}.weight") for n in names]
        for tensor, gguf_name in zip(found, gguf_names, strict=True):
            if tensor is None:
                raise CheckpointError(f"{self.gguf.path}: tensor '{gguf_name}' is missing")
        for tensor in found:
            self._mark_read(tensor)
        gate, up, down = (t.data for t in found)
        types = tuple(t.type_name for t in found)
        return MergedExperts(gate, up, down, types, tuple(gguf_names), found[0].path)

    def _mark_read(self, tensor: GgufTensor) -> None:
        if tensor.name not in self._read:
            self._read.add(tensor.name)
            self._bar.update()

    def unread_names(self) -> list[str]:
        """GGUF tensor names nothing has asked for, sorted."""
        return sorted(self.gguf.tensors.keys() - self._read)

    def close(self) -> None:
        self._bar.close()


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` without its dims of 1 (the converter squeezes some tensors: a conv1d weight
    [C, 1, K] is stored [C, K]; the bytes are the same)."""
    dims = tuple(d for d in shape if d != 1)
    return dims or (1,)


def _as_tuple(names: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if names is None else names if isinstance(names, tuple) else (names,)


def _dequantized(tensor: GgufTensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor's values as `dtype` [*shape]: a view of the mapping when stored so, else a new
    tensor (block formats through gguf.quants, exact in float32, then cast)."""
    stored = _FLOAT_TYPES.get(tensor.type_name)
    if stored is not None:
        values = tensor.data.view(torch.uint8).view(stored).reshape(tensor.shape)
        return values if stored == dtype else values.to(dtype)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType[tensor.type_name]
        values = dequantize(tensor.data.numpy(), qtype)  # float32 [*shape]
    except (KeyError, NotImplementedError) as exc:
        raise CheckpointError(
            f"{tensor.path}: tensor '{tensor.name}' has type {tensor.type_name}, which "
            f"cannot be dequantised ({exc})"
        ) from exc
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
