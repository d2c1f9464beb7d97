"""Mixture-of-Experts layer: softmax top-k router, routed SwiGLU experts, optional shared expert.

`moe_reference` is the plain expert math, kept forever as the oracle every fast path is
checked against.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridmoe.layers.linear import GatedMLP, Linear
from hybridmoe.loader.weights import WeightSource
from hybridmoe.models.config import ModelConfig


@dataclass
class ExpertWeights:
    """One MoE layer's routed experts, each a view into the checkpoint."""

    gate: list[torch.Tensor]  # E x [I, H]
    up: list[torch.Tensor]  # E x [I, H]
    down: list[torch.Tensor]  # E x [H, I]

    @property
    def num_experts(self) -> int:
        return len(self.gate)

    @classmethod
    def load(
        cls,
        source: WeightSource,
        prefix: str,
        cfg: ModelConfig,
        names: tuple[str, str, str],
    ) -> ExpertWeights:
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
        per_projection = [
            [source.get(f"{prefix}.{e}.{name}.weight", shape) for e in range(cfg.num_experts)]
            for name, shape in zip(names, shapes, strict=True)
        ]
        return cls(*per_projection)


def route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_ids [T, K] int64, topk_weights [T, K] in logits dtype)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights.to(router_logits.dtype)


def group_routes(topk_ids: torch.Tensor) -> dict[int, tuple[list[int], list[int]]]:
    """topk_ids [T, K] -> {expert: (token indices, k positions)}; ids < 0 are skipped."""
    groups: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for t, row in enumerate(topk_ids.tolist()):
        for k, expert in enumerate(row):
            if expert >= 0:
                tokens, ks = groups[expert]
                tokens.append(t)
                ks.append(k)
    return groups


def moe_reference(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertWeights
) -> torch.Tensor:
    """Σ_k w[t,k] · down_e(silu(gate_e x_t) ⊙ up_e x_t) with e = topk_ids[t,k]; ids < 0 skipped.

    x [T, H], topk_ids [T, K], topk_weights [T, K] -> [T, H] in x's dtype.
    """
    out = torch.zeros_like(x)
    route_weights = topk_weights.reshape(-1, 1)  # [T*K, 1], route t*K + k
    top_k = topk_ids.shape[1]
    for expert, (tokens, ks) in sorted(group_routes(topk_ids).items()):
        routes = [t * top_k + k for t, k in zip(tokens, ks, strict=True)]
        if len(tokens) == 1:  # the decode case: slices instead of index tensors
            t, r = tokens[0], routes[0]
            out[t : t + 1] += _expert_mlp(x[t : t + 1], experts, expert) * route_weights[r : r + 1]
            continue
        token_idx = torch.tensor(tokens)
        h = _expert_mlp(x[token_idx], experts, expert)  # [n, H]
        out.index_add_(0, token_idx, h * route_weights[torch.tensor(routes)])
    return out


def _expert_mlp(h: torch.Tensor, experts: ExpertWeights, expert: int) -> torch.Tensor:
    """h [n, H] -> down(silu(gate h) * up h) [n, H] for one expert."""
    h = F.silu(F.linear(h, experts.gate[expert])) * F.linear(h, experts.up[expert])
    return F.linear(h, experts.down[expert])


class MoELayer:
    """Router + routed experts (+ a sigmoid-gated shared expert where the family has one)."""

    def __init__(self, cfg: ModelConfig, source: WeightSource, prefix: str, names: tuple[str, ...]):
        self.cfg = cfg
        self.router = Linear.load(source, f"{prefix}.gate", cfg.hidden_size, cfg.num_experts, False)
        self.experts = ExpertWeights.load(source, f"{prefix}.experts", cfg, names)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP.load(
                source,
                f"{prefix}.shared_expert",
                cfg.hidden_size,
                cfg.shared_expert_intermediate_size,
            )
            self.shared_expert_gate = Linear.load(
                source, f"{prefix}.shared_expert_gate", cfg.hidden_size, 1, bias=False
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        topk_ids, topk_weights = route(self.router(flat), self.cfg.top_k, self.cfg.norm_topk_prob)
        out = self.run_experts(flat, topk_ids, topk_weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)

    def run_experts(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return moe_reference(x, topk_ids, topk_weights, self.experts)
