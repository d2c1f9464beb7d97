"""Dense projections. Weights stay views into the memory-mapped checkpoint when dtypes agree
(unless quantised at load: --dense-format), and a GGUF file's quantised projections stay in
its types (GgufWeightSource.stored_projection)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.kernels.projection import DenseProjection
from hybridmoe.loader.weights import WeightSource
from hybridmoe.quant.formats import WEIGHT_FORMATS, WeightFormat


class Linear(DenseProjection):
    """A checkpoint's dense projection (kernels/projection.py: the CPU kernel for decode
    steps, torch otherwise)."""

    @classmethod
    def load(
        cls, source: WeightSource, name: str, in_features: int, out_features: int, bias: bool
    ) -> Linear:
        bias_t = source.get(f"{name}.bias", (out_features,)) if bias else None
        found = stored_projection(source, f"{name}.weight", out_features, in_features)
        if found is not None:
            return cls(found[0], bias_t, found[1], in_features)
        return cls(source.get(f"{name}.weight", (out_features, in_features)), bias_t)

    def dense_tensors(self) -> list[torch.Tensor]:
        return self.tensors()


def stored_projection(
    source: WeightSource, name: str, out_features: int, in_features: int
) -> tuple[torch.Tensor, WeightFormat] | None:
    """The projection weight `name` [out, in] in the source's quantised type where it offers
    one (a GGUF file: GgufWeightSource.stored_projection) and that type is a weight format
    whose blocks divide the rows: (the stored bytes, a view of the file, the format); else
    None (the caller reads the dequantised values)."""
    offer = getattr(source, "stored_projection", None)
    found = None if offer is None else offer(name, (out_features, in_features))
    if found is None:
        return None
    stored, type_name = found
    fmt = WEIGHT_FORMATS.get(type_name.lower())
    if fmt is None or not fmt.is_quantized or in_features % fmt.block_size:
        return None
    if tuple(stored.shape) != (out_features, fmt.row_bytes(in_features)):
        return None
    return stored, fmt


class GatedMLP:
    """SwiGLU MLP: down(silu(gate x) * up x)."""

    def __init__(self, gate: Linear, up: Linear, down: Linear):
        self.gate, self.up, self.down = gate, up, down

    @classmethod
    def load(
        cls,
        source: WeightSource,
        prefix: str,
        hidden: int,
        intermediate: int,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ) -> GatedMLP:
        gate, up, down = names
        return cls(
            Linear.load(source, f"{prefix}.{gate}", hidden, intermediate, bias=False),
            Linear.load(source, f"{prefix}.{up}", hidden, intermediate, bias=False),
            Linear.load(source, f"{prefix}.{down}", intermediate, hidden, bias=False),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))

    def to(self, device: torch.device) -> None:
        for linear in (self.gate, self.up, self.down):
            linear.to(device)

    def dense_tensors(self) -> list[torch.Tensor]:
        return [t for linear in (self.gate, self.up, self.down) for t in linear.dense_tensors()]

    def projections(self) -> list[Linear]:
        return [self.gate, self.up, self.down]
