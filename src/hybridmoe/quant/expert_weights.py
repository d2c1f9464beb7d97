"""ExpertWeights: one MoE layer's routed experts as the checkpoint stores them, one matrix per
expert and projection (views of the memory-mapped file), before they are stacked into an
ExpertBank (quant/bank.py), or computed from in place by the `resident` target on the cpu
device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridmoe.loader.weights import WeightSource, aligned
from hybridmoe.quant.expert_math import (
    SILU,
    ExpertActivation,
    ExpertBiases,
    activate,
    add_down_bias,
)


@dataclass
class ExpertWeights:
    """One MoE layer's routed experts, each matrix a view into the checkpoint: the `resident`
    target on the cpu device computes from them in place; every other target stacks them into
    a ExpertBank."""

    gate: list[torch.Tensor]  # E x [I, H]
    up: list[torch.Tensor]  # E x [I, H]
    down: list[torch.Tensor]  # E x [H, I]
    biases: ExpertBiases | None = None  # the family's expert biases, if it has them
    activation: ExpertActivation = field(default=SILU)

    @property
    def num_experts(self) -> int:
        return len(self.gate)

    @classmethod
    def load(
        cls,
        source: WeightSource,
        prefix: str,
        shape: tuple[int, int, int],
        names: tuple[str, str, str],
    ) -> ExpertWeights:
        """`prefix`.{e}.{name}.weight for e < E; shape = (E, H, I)."""
        num_experts, hidden, inter = shape
        shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
        # Unaligned views: most targets copy them into a bank (aligned) anyway, and one that
        # computes from them in place aligns them first (align()).
        per_projection = [
            [
                source.get(f"{prefix}.{e}.{name}.weight", shape, align=False)
                for e in range(num_experts)
            ]
            for name, shape in zip(names, shapes, strict=True)
        ]
        return cls(*per_projection)

    def align(self) -> None:
        """Make every matrix 64-byte aligned (loader.weights.aligned: a CPU kernel's result may
        depend on its weight's address), copying the few that are not."""
        self.gate, self.up, self.down = (
            [aligned(w) for w in ws] for ws in (self.gate, self.up, self.down)
        )

    def expert_mlp(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        """h [n, H] -> down(act(gate h, up h)) [n, H] in h's dtype (the weights' dtype), biases
        and activation as quant/expert_math.py's contract says."""
        gate, up = F.linear(h, self.gate[expert]), F.linear(h, self.up[expert])
        act = activate(gate, up, expert, self.biases, self.activation)
        return add_down_bias(F.linear(act, self.down[expert]), expert, self.biases)
