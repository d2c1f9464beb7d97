"""HostExpertBank: one MoE layer's routed experts stacked [E, ...] in host memory.

The bank is the single home of a layer's expert weights: it is filled from the checkpoint
one layer at a time and the layer's expert matrices are then re-pointed at views of it, so
the memory-mapped originals are no longer referenced and no second full copy stays alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HostExpertBank:
    gate_up: torch.Tensor  # [E, 2I, H]: gate rows, then up rows
    down: torch.Tensor  # [E, H, I]

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[2]

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert occupies (what fetching it copies)."""
        return (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()

    @classmethod
    def stack(
        cls, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]
    ) -> HostExpertBank:
        """A bank holding a copy of the per-expert gate/up [I, H] and down [H, I] matrices."""
        pairs = zip(gate, up, strict=True)
        return cls(gate_up=torch.stack([torch.cat(pair) for pair in pairs]), down=torch.stack(down))
