"""Routing: router logits to top-k expert ids and weights, and routes grouped by expert."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F


def route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, weights_fp32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_ids [T, K] int64, topk_weights [T, K]): softmax in
    float32, top-k, optionally renormalised, the weights then rounded to the logits' dtype
    unless `weights_fp32` (each family rounds where its reference does: Mixtral keeps them)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights if weights_fp32 else topk_weights.to(router_logits.dtype)


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


def combine_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_mlp: Callable[[torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """Σ_k w[t,k] · expert_mlp(x_t, topk_ids[t,k]) over routes with ids >= 0, expert by expert
    in ascending id order. x [T, H], topk_ids/topk_weights [T, K] -> the float32 partial
    [T, H]: each expert's output times its route weight, and the sum, in float32 (the
    accumulation contract; the caller rounds once). expert_mlp(h [n, H], expert) -> [n, H]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # stays zero if all < 0
    route_weights = topk_weights.reshape(-1, 1).float()  # [T*K, 1], route t*K + k
    top_k = topk_ids.shape[1]
    for expert, (tokens, ks) in sorted(group_routes(topk_ids).items()):
        routes = [t * top_k + k for t, k in zip(tokens, ks, strict=True)]
        if len(tokens) == 1:  # the decode case: slices instead of index tensors
            t, r = tokens[0], routes[0]
            out[t : t + 1] += expert_mlp(x[t : t + 1], expert).float() * route_weights[r : r + 1]
            continue
        token_idx = torch.tensor(tokens, device=x.device)  # index_add_ needs out's device
        h = expert_mlp(x[token_idx], expert).float()  # [n, H]
        out.index_add_(0, token_idx, h * route_weights[torch.tensor(routes, device=x.device)])
    return out
