"""Routing: routers (a registry of kinds) turn hidden states into top-k expert ids and
weights; routes are grouped by expert for the reference expert math."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from hybridmoe.kernels import glue
from hybridmoe.kernels.projection import DenseProjection
from hybridmoe.registry import registering


class Router(Protocol):
    """x [T, H] -> (topk_ids [T, K] int64, topk_weights [T, K]); the weights in the dtype the
    family's reference keeps them in."""

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def to(self, device: torch.device) -> None: ...

    def dense_tensors(self) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class RouterSpec:
    """What a family's config says about its router; each kind reads the fields it needs."""

    top_k: int
    norm_topk_prob: bool
    weights_fp32: bool  # top-k weights kept in float32 (Mixtral), else the activation dtype


# kind -> factory(tensors by name: "weight" [E, H] (+ kind-specific), spec) -> Router
ROUTERS: dict[str, Callable[[dict[str, torch.Tensor], RouterSpec], Router]] = {}


def register_router(kind: str) -> Callable:
    """Decorator: register a Router factory under `kind`."""
    return registering(ROUTERS, "router kind", kind)


def create_router(kind: str, tensors: dict[str, torch.Tensor], spec: RouterSpec) -> Router:
    if kind not in ROUTERS:
        raise ValueError(f"unknown router kind {kind!r}; registered: {', '.join(sorted(ROUTERS))}")
    return ROUTERS[kind](tensors, spec)


@dataclass(eq=False)
class SoftmaxTopKRouter:
    """Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE: a linear gate, softmax in float32, top-k, the k
    weights optionally renormalised."""

    gate: DenseProjection  # [E, H], kept as stored (never quantised: it picks the experts)
    spec: RouterSpec

    @classmethod
    def create(cls, tensors: dict[str, torch.Tensor], spec: RouterSpec) -> SoftmaxTopKRouter:
        if set(tensors) != {"weight"}:
            raise ValueError(f"the softmax_topk router has a weight only, got {sorted(tensors)}")
        return cls(DenseProjection(tensors["weight"]), spec)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """route(gate(x), ...): on the host at decode sizes the gate, softmax and top-k in one
        kernel call (DenseProjection.route), its logits routed by torch where it leaves a row
        to torch (a tie), else the gate's projection and route()."""
        spec = self.spec
        _, top_k, renorm, weights_dtype = self.block_route(x.dtype)
        fast = self.gate.route(x, top_k, renorm, weights_dtype)
        if isinstance(fast, tuple):
            return fast
        if fast is not None:  # the logits, for torch to route
            return self.route_logits(fast)
        logits = self.gate(x)  # [T, E] in x's dtype
        return route(logits, spec.top_k, spec.norm_topk_prob, spec.weights_fp32)

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing of the gate's logits [T, E] that a kernel step left to torch (a tie)."""
        spec = self.spec
        return route_torch(logits, spec.top_k, spec.norm_topk_prob, spec.weights_fp32)

    def block_route(self, dtype: torch.dtype) -> tuple:
        """(gate, k, renormalise, weights dtype): what __call__'s kernel step takes, for a
        caller that computes it in its own kernel call on activations of `dtype` (the
        attention block: kernels/attention_block.decode_block, which checks the rest)."""
        spec = self.spec
        weights_dtype = torch.float32 if spec.weights_fp32 else dtype
        return self.gate, spec.top_k, spec.norm_topk_prob, weights_dtype

    def to(self, device: torch.device) -> None:
        self.gate.to(device)

    def dense_tensors(self) -> list[torch.Tensor]:
        return self.gate.tensors()


register_router("softmax_topk")(SoftmaxTopKRouter.create)


@dataclass(eq=False)
class TopKSoftmaxRouter:
    """gpt-oss: a linear gate with a bias, top-k of the logits, softmax over the k chosen in
    the logits' dtype (as GptOssTopKRouter: its weights round to the activation dtype)."""

    gate: DenseProjection  # [E, H] + bias [E], kept as stored (never quantised)
    spec: RouterSpec

    @classmethod
    def create(cls, tensors: dict[str, torch.Tensor], spec: RouterSpec) -> TopKSoftmaxRouter:
        if set(tensors) != {"weight", "bias"}:
            raise ValueError(
                f"the topk_softmax router has a weight and a bias, got {sorted(tensors)}"
            )
        return cls(DenseProjection(tensors["weight"], tensors["bias"]), spec)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)  # [T, E] in x's dtype
        top_logits, topk_ids = torch.topk(logits, self.spec.top_k, dim=-1)  # [T, K]
        return topk_ids, F.softmax(top_logits, dim=-1, dtype=top_logits.dtype)

    def to(self, device: torch.device) -> None:
        self.gate.to(device)

    def dense_tensors(self) -> list[torch.Tensor]:
        return self.gate.tensors()


register_router("topk_softmax")(TopKSoftmaxRouter.create)


def route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, weights_fp32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """route_torch's ids and weights, bit for bit: on the host (a decode step's few rows) the
    softmax, top-k, renormalisation and rounding are one numba call (kernels/numba_glue:
    softmax_topk_route, torch's softmax reproduced for its AVX2 and AVX512 builds; on other
    builds topk_route after torch's softmax), torch.topk's pick and order among equal values
    included (numba_glue._torch_topk), unless a row's k + 1 largest probabilities hold a tie
    torch.topk breaks otherwise (numba_glue._reproduced false: k * 64 <= experts, k > 17, or
    off Linux; then torch decides)."""
    dtype = torch.float32 if weights_fp32 else router_logits.dtype
    routed = glue.softmax_route(router_logits, top_k, norm_topk_prob, dtype)
    if routed is not None:
        return routed
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    routed = glue.route_topk(probs, top_k, norm_topk_prob, dtype)
    if routed is not None:
        return routed
    return _topk_torch(probs, router_logits.dtype, top_k, norm_topk_prob, weights_fp32)


def route_torch(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, weights_fp32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_ids [T, K] int64, topk_weights [T, K]): softmax in
    float32, top-k, optionally renormalised, the weights then rounded to the logits' dtype
    unless `weights_fp32` (each family rounds where its reference does: Mixtral keeps them)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    return _topk_torch(probs, router_logits.dtype, top_k, norm_topk_prob, weights_fp32)


def _topk_torch(
    probs: torch.Tensor, dtype: torch.dtype, top_k: int, norm_topk_prob: bool, weights_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights if weights_fp32 else topk_weights.to(dtype)


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
    [T, H] of the accumulation contract: each expert's output times its route weight in the
    dtype torch promotes the two to (bf16 for a bf16 router weight, float32 for a float32
    one), summed in float32 (the caller rounds once). expert_mlp(h [n, H], expert) -> [n, H]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # stays zero if all < 0
    route_weights = topk_weights.reshape(-1, 1)  # [T*K, 1], route t*K + k
    top_k = topk_ids.shape[1]
    for expert, (tokens, ks) in sorted(group_routes(topk_ids).items()):
        routes = [t * top_k + k for t, k in zip(tokens, ks, strict=True)]
        if len(tokens) == 1:  # the decode case: slices instead of index tensors
            t, r = tokens[0], routes[0]
            weighted = expert_mlp(x[t : t + 1], expert) * route_weights[r : r + 1]  # [1, H]
            out[t : t + 1] += weighted.float()
            continue
        token_idx = torch.tensor(tokens, device=x.device)  # index_add_ needs out's device
        h = expert_mlp(x[token_idx], expert)  # [n, H]
        weighted = h * route_weights[torch.tensor(routes, device=x.device)]  # [n, H]
        out.index_add_(0, token_idx, weighted.float())
    return out
