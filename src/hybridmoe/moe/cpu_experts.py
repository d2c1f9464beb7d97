"""Routed expert math on a HostExpertBank, run by the CPU worker; a registry of kernels.

`bank_moe` is the pure-torch kernel: the same sum as `moe_reference` (layers/moe.py), but one
fused gate_up GEMM per expert on the bank's stacked weights. Faster kernels (numba, ...) are
added to `CPU_EXPERT_FNS` through `register_cpu_expert_fn`; their factories import them
lazily, so `import hybridmoe` works where they are not installed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridmoe.moe.host_banks import HostExpertBank
from hybridmoe.moe.routing import combine_experts

# (x [T, H], expert_ids [T, K], weights [T, K], bank) -> [T, H]; ids < 0 skipped
CpuExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, HostExpertBank], torch.Tensor]

# kernel name -> factory; a factory imports its optional dependency when called
CPU_EXPERT_FNS: dict[str, Callable[[], CpuExpertFn]] = {}


def register_cpu_expert_fn(
    name: str,
) -> Callable[[Callable[[], CpuExpertFn]], Callable[[], CpuExpertFn]]:
    """Decorator: register a zero-argument factory that returns a CpuExpertFn under `name`."""

    def register(factory: Callable[[], CpuExpertFn]) -> Callable[[], CpuExpertFn]:
        if name in CPU_EXPERT_FNS:
            raise ValueError(f"CPU expert kernel {name!r} is already registered")
        CPU_EXPERT_FNS[name] = factory
        return factory

    return register


def create_cpu_expert_fn(name: str = "torch") -> CpuExpertFn:
    """The CPU expert kernel registered as `name`."""
    if name not in CPU_EXPERT_FNS:
        choices = ", ".join(sorted(CPU_EXPERT_FNS))
        raise ValueError(f"unknown CPU expert kernel {name!r}; choose one of: {choices}")
    return CPU_EXPERT_FNS[name]()


def bank_moe(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, bank: HostExpertBank
) -> torch.Tensor:
    """Σ_k w[t,k] · down_e(silu(gate_e x_t) ⊙ up_e x_t) with e = expert_ids[t,k]; ids < 0 skipped.

    x [T, H], expert_ids [T, K], weights [T, K], all in host memory -> [T, H] in x's dtype.
    Equals `moe_reference` on the bank's ExpertWeights views up to summation order.
    """
    return combine_experts(
        x, expert_ids, weights, lambda h, expert: _bank_expert_mlp(h, bank, expert)
    )


def _bank_expert_mlp(h: torch.Tensor, bank: HostExpertBank, expert: int) -> torch.Tensor:
    """h [n, H] -> down(silu(gate h) * up h) [n, H], gate and up in one GEMM."""
    gate, up = F.linear(h, bank.gate_up[expert]).chunk(2, dim=-1)  # 2 x [n, I]
    return F.linear(F.silu(gate) * up, bank.down[expert])


@register_cpu_expert_fn("torch")
def _create_torch_expert_fn() -> CpuExpertFn:
    return bank_moe
