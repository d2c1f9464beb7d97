"""Routing: router logits to top-k expert ids and weights, and routes grouped by expert."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F


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
