"""What a routed expert computes besides its three weight matrices: its activation (how the
gate and up projections combine) and, for families that have them, its biases.

A family's config declares both (ModelConfig.expert_activation / expert_bias); the layer loads
them into the bank beside the weights (ExpertBank.activation / .biases), so every expert kernel
reads them from the one place: the torch references (`ExpertBank.expert_mlp`,
`ExpertWeights.expert_mlp`), the accelerator's `gathered_moe`, the numba CPU kernel and
prefill; a fetch copies an expert's biases into its cache slot with its weights.

The rounding contract, for activations of dtype A (float32 is exact at every step; bfloat16
rounds where torch rounds a bf16 op, as `transformers` computes these experts):
- a projection's output is rounded to A, then its bias (stored in any float dtype, cast to A)
  is added in A: `x @ W` rounded, `+ b` rounded once more (`transformers` adds the bias with
  `out.add_(bias)` after the matmul, never inside it);
- the activation runs op by op in A, each op rounded (a Python-float constant such as alpha
  kept in float32, as torch keeps a scalar operand of a bf16 op):
  `silu`: silu(gate) * up;
  `clamped_swiglu` (gpt-oss): gate = min(gate, limit); up = clamp(up, -limit, limit);
  glu = gate * sigmoid(gate * alpha); out = (up + 1) * glu.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# activation kind -> the numba kernel's code for it (kernels/numba_moe.py)
ACTIVATION_CODES = {"silu": 0, "clamped_swiglu": 1}


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert turns its gate and up projections [n, I] into down's input [n, I]."""

    kind: str = "silu"  # a key of ACTIVATION_CODES
    alpha: float = 1.0  # clamped_swiglu: the sigmoid's gain
    limit: float = math.inf  # clamped_swiglu: gate clamped above, up on both sides

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATION_CODES:
            raise ValueError(
                f"unknown expert activation {self.kind!r}; known: {', '.join(ACTIVATION_CODES)}"
            )
        if not self.limit > 0:
            raise ValueError(f"expert activation limit must be > 0, got {self.limit}")

    @property
    def code(self) -> int:
        return ACTIVATION_CODES[self.kind]

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [n, I] in the activation dtype -> [n, I] in it, each op rounded there."""
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu


SILU = ExpertActivation()


@dataclass(frozen=True)
class ExpertBiases:
    """One layer's expert biases, beside its bank: gate_up [E, 2I] (gate's I, then up's I: the
    bank's row order, whatever order the checkpoint stored them in) and down [E, H]."""

    gate_up: torch.Tensor  # [E, 2I]
    down: torch.Tensor  # [E, H]

    def __post_init__(self) -> None:
        ok = self.gate_up.dim() == 2 and self.down.dim() == 2
        if not ok or self.gate_up.shape[0] != self.down.shape[0] or self.gate_up.shape[1] % 2:
            raise ValueError(
                f"ExpertBiases: gate_up {tuple(self.gate_up.shape)} is not [E, 2I] or down "
                f"{tuple(self.down.shape)} is not [E, H]"
            )

    @property
    def nbytes_per_expert(self) -> int:
        return (self.gate_up.nbytes + self.down.nbytes) // max(self.down.shape[0], 1)

    def tensors(self) -> list[torch.Tensor]:
        return [self.gate_up, self.down]

    def placed(self, place) -> ExpertBiases:
        """ExpertBiases of place(tensor) for each tensor."""
        return ExpertBiases(place(self.gate_up), place(self.down))

    def empty(self, num: int, device: torch.device | str) -> ExpertBiases:
        """Zero biases of `num` experts of these shapes and dtype on `device` (cache slots)."""
        return ExpertBiases(
            torch.zeros((num, self.gate_up.shape[1]), dtype=self.gate_up.dtype, device=device),
            torch.zeros((num, self.down.shape[1]), dtype=self.down.dtype, device=device),
        )

    def tensor_pairs(self, other: ExpertBiases) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(this, other) tensor pairs whose rows [expert] hold one expert's biases."""
        return [(self.gate_up, other.gate_up), (self.down, other.down)]


def activate(
    gate: torch.Tensor,
    up: torch.Tensor,
    expert: int | torch.Tensor,
    biases: ExpertBiases | None,
    activation: ExpertActivation,
) -> torch.Tensor:
    """gate, up [n, I] projections in the activation dtype -> down's input [n, I] in it: the
    expert's gate and up biases added (for a tensor of n expert ids, each row its own expert's),
    then the activation, at the contract's rounding points."""
    if biases is not None:
        inter = gate.shape[-1]
        bias = biases.gate_up[expert].to(gate.dtype)  # [2I] or [n, 2I]
        gate, up = gate + bias[..., :inter], up + bias[..., inter:]
    return activation(gate, up)


def add_down_bias(
    out: torch.Tensor, expert: int | torch.Tensor, biases: ExpertBiases | None
) -> torch.Tensor:
    """out [n, H] (down's output in the activation dtype) + the expert's down bias, rounded."""
    if biases is None:
        return out
    return out + biases.down[expert].to(out.dtype)
