"""Dense projections. Weights stay views into the memory-mapped checkpoint when dtypes agree
(unless quantised at load: --dense-format), and a GGUF file's quantised projections stay in
its types (GgufWeightSource.stored_projection)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.kernels.projection import DenseProjection
from hybridmoe.loader.weights import WeightSource


class Linear(DenseProjection):
    """A checkpoint's dense projection (kernels/projection.py: the CPU kernel for decode
    steps, torch otherwise)."""

    @classmethod
    def load(
        cls, source: WeightSource, name: str, in_features: int, out_features: int, bias: bool
    ) -> Linear:
        bias_t = source.get(f"{name}.bias", (out_features,)) if bias else None
        offer = getattr(source, "stored_projection", None)  # a GGUF file's
        found = None if offer is None else offer(f"{name}.weight", (out_features, in_features))
        if found is not None:
            stored, fmt = found
            return cls(stored, bias_t, fmt, in_features)
        return cls(source.get(f"{name}.weight", (out_features, in_features)), bias_t)

    def dense_tensors(self) -> list[torch.Tensor]:
        return self.tensors()


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
