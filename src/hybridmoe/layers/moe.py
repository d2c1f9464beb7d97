"""Mixture-of-Experts layer: a router, one expert backend, and a shared expert where the family
has one.

`moe_reference` is the plain expert math, kept forever as the oracle every fast path is
checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridmoe.layers.linear import GatedMLP, Linear
from hybridmoe.loader.weights import WeightSource
from hybridmoe.moe.backends import ExpertBackend, ResidentExperts
from hybridmoe.moe.routing import Router, RouterSpec, combine_experts, create_router
from hybridmoe.quant.bank import ExpertBank, ExpertWeights
from hybridmoe.quant.merged_bank import load_experts

if TYPE_CHECKING:  # layers sit below models: no import of them at run time
    from hybridmoe.config.model import ModelConfig

# (cfg, source, the experts' prefix) -> the layer's routed experts, for a family whose
# checkpoint does not store them per expert (gpt-oss: one fused tensor per projection)
ExpertsLoader = Callable[["ModelConfig", WeightSource, str], ExpertWeights | ExpertBank]


def moe_reference(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertWeights
) -> torch.Tensor:
    """Σ_k w[t,k] · down_e(silu(gate_e x_t) ⊙ up_e x_t) with e = topk_ids[t,k]; ids < 0 skipped.

    x [T, H], topk_ids [T, K], topk_weights [T, K] -> the float32 partial [T, H]: each
    expert's MLP in x's dtype (as `transformers` computes it), the weighted sum in float32.
    """
    return combine_experts(x, topk_ids, topk_weights, experts.expert_mlp)


@dataclass(eq=False)
class SigmoidGatedSharedExpert:
    """Qwen2-MoE's shared expert: sigmoid(gate x) * mlp(x), added to the routed output."""

    mlp: GatedMLP
    gate: Linear  # [1, H]

    @classmethod
    def load(cls, source: WeightSource, prefix: str, cfg: ModelConfig) -> SigmoidGatedSharedExpert:
        hidden = cfg.hidden_size
        mlp = GatedMLP.load(
            source, f"{prefix}.shared_expert", hidden, cfg.shared_expert_intermediate_size
        )
        return cls(mlp, Linear.load(source, f"{prefix}.shared_expert_gate", hidden, 1, bias=False))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.mlp(x)

    def to(self, device: torch.device) -> None:
        self.mlp.to(device)
        self.gate.to(device)

    def dense_tensors(self) -> list[torch.Tensor]:
        return self.mlp.dense_tensors() + self.gate.dense_tensors()

    def projections(self) -> list[Linear]:
        """The MLP's (the [1, H] gate stays as stored, like the router)."""
        return self.mlp.projections()


# kind -> loader(source, MoE block prefix, cfg); the family's config says which kind it has
SHARED_EXPERTS: dict[str, Callable[[WeightSource, str, ModelConfig], SigmoidGatedSharedExpert]] = {
    "sigmoid_gated": SigmoidGatedSharedExpert.load,
}


def _load_router(cfg: ModelConfig, source: WeightSource, prefix: str, kind: str) -> Router:
    tensors = {"weight": source.get(f"{prefix}.weight", (cfg.num_experts, cfg.hidden_size))}
    if cfg.router_bias:
        tensors["bias"] = source.get(f"{prefix}.bias", (cfg.num_experts,))
    spec = RouterSpec(cfg.top_k, cfg.norm_topk_prob, cfg.router_weights_fp32)
    return create_router(kind, tensors, spec)


class OffloadMoELayer:
    """Router + exactly one expert backend (+ a shared expert where the family has one).

    The layer owns neither placement nor scheduling: it starts with its experts resident where
    they were loaded (`ResidentExperts` over the checkpoint's matrices) and the MoE runtime
    installs the decode target's backend with `use()`. Every backend returns the routed
    experts' float32 partial, rounded here once to the activation dtype (the accumulation
    contract).
    """

    def __init__(
        self,
        router: Router,
        experts: ExpertBackend,
        moe_idx: int,
        shared_expert: SigmoidGatedSharedExpert | None = None,
    ):
        self.router, self.experts, self.moe_idx = router, experts, moe_idx
        self.shared_expert = shared_expert

    @classmethod
    def load(
        cls,
        cfg: ModelConfig,
        source: WeightSource,
        prefix: str,
        names: tuple[str, str, str],
        moe_idx: int,
        router_kind: str = "softmax_topk",
        shared_expert_kind: str | None = None,
        router_name: str = "gate",
        experts_loader: ExpertsLoader | None = None,
    ) -> OffloadMoELayer:
        """The MoE block at `prefix` with the family's router and shared-expert kinds; a shared
        expert is loaded when the family has a kind and the config a width for it. The router
        is `prefix`.`router_name` (with a bias when the config says so); the experts come from
        `experts_loader` when the family has one, else one tensor per expert and projection."""
        router = _load_router(cfg, source, f"{prefix}.{router_name}", router_kind)
        shape = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if experts_loader is not None:
            experts = experts_loader(cfg, source, f"{prefix}.experts")
        elif cfg.expert_bias or cfg.expert_activation != "silu":
            raise ValueError(
                f"{cfg.architecture}: experts with biases or a {cfg.expert_activation} "
                "activation need the family's experts_loader"
            )
        else:
            experts = load_experts(source, f"{prefix}.experts", shape, names)
        shared = None
        if shared_expert_kind is not None and cfg.shared_expert_intermediate_size:
            shared = SHARED_EXPERTS[shared_expert_kind](source, prefix, cfg)
        return cls(router, ResidentExperts(experts, loaded=True), moe_idx, shared)

    def use(self, experts: ExpertBackend) -> None:
        """Compute the routed experts with `experts` from now on (the MoE runtime's choice)."""
        self.experts = experts

    def to(self, device: torch.device) -> None:
        """Moves the router and the shared expert; the routed experts are the runtime's."""
        self.router.to(device)
        if self.shared_expert is not None:
            self.shared_expert.to(device)

    def dense_tensors(self) -> list[torch.Tensor]:
        """The weights to() moves."""
        found = self.router.dense_tensors()
        if self.shared_expert is not None:
            found += self.shared_expert.dense_tensors()
        return found

    def projections(self) -> list[Linear]:
        """The shared expert's (the router stays as stored: it picks the experts)."""
        return [] if self.shared_expert is None else self.shared_expert.projections()

    def block_experts(
        self, x: torch.Tensor, top_k: int, weights_dtype: torch.dtype
    ) -> tuple | None:
        """What the attention block takes to compute this layer's decode step of the routed
        experts for the normed x [B, 1, H] after its routing (routes of `top_k` weights in
        `weights_dtype`), where the backend offers it (CpuExperts.block_experts); None
        otherwise. The block's partial then comes back through __call__'s `partial`."""
        offer = getattr(self.experts, "block_experts", None)
        return None if offer is None else offer(x.view(-1, x.shape[-1]), top_k, weights_dtype)

    def __call__(
        self,
        x: torch.Tensor,
        is_decode: bool = False,
        rounded: bool = True,
        routes: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None = None,
        partial: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H] in x's dtype; with `rounded=False` the routed sum may come
        back as the float32 partial, for a caller that rounds it to x's dtype before anything
        else (the residual add: layers/norm.py's add_* take it, in one numba call on a decode
        step instead of a cast op first). A shared expert's layer rounds here either way.
        `routes`: the router's (ids, weights) of x where the caller computed them already, or
        the gate's logits [N, E] where its kernel left the routing to torch (a tie): the
        attention block's, with the router's bits (DecoderLayer). `partial`: the routed
        experts' float32 partial of those routes where the attention block computed
        it too (block_experts: decode's bits; [B, 1, H], x's shape), counted here as the
        backend's decode step."""
        if partial is not None:
            self.experts.block_done(routes[0])
            if not rounded and self.shared_expert is None:
                return partial
            flat, out = x.reshape(-1, x.shape[-1]), partial.view(-1, x.shape[-1])
        else:
            flat = x.reshape(-1, x.shape[-1])  # [N, H]
            if routes is None:
                routes = self.router(flat)
            elif isinstance(routes, torch.Tensor):
                routes = self.router.route_logits(routes)
            topk_ids, topk_weights = routes  # [N, K] each
            run = self.experts.decode if is_decode else self.experts.prefill
            out = run(flat, topk_ids, topk_weights)  # the float32 partial
        if rounded or self.shared_expert is not None:
            out = out.to(x.dtype)  # the one rounding
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.view(x.shape)
