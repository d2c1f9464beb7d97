"""OffloadMoELayer's one rounding: by default the layer rounds the routed experts' float32
partial to the activation dtype; with rounded=False (DecoderLayer's call) it hands the partial
over for the residual add to round (layers/norm.py), unless a shared expert has to be added in
the activation dtype first. Either way the layer's output, rounded, has the same bits."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.layers.linear import GatedMLP, Linear
from hybridmoe.layers.moe import OffloadMoELayer, SigmoidGatedSharedExpert
from hybridmoe.moe.backends import ResidentExperts
from hybridmoe.moe.routing import RouterSpec, create_router
from hybridmoe.quant.bank import ExpertWeights

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 2


def _layer(shared: bool) -> OffloadMoELayer:
    gen = torch.Generator().manual_seed(5)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.2).bfloat16()

    experts = ExpertWeights(
        gate=[weight(INTER, HIDDEN) for _ in range(EXPERTS)],
        up=[weight(INTER, HIDDEN) for _ in range(EXPERTS)],
        down=[weight(HIDDEN, INTER) for _ in range(EXPERTS)],
    )
    router = create_router(
        "softmax_topk", {"weight": weight(EXPERTS, HIDDEN)}, RouterSpec(TOP_K, True, False)
    )
    shared_expert = None
    if shared:
        mlp = GatedMLP(
            Linear(weight(INTER, HIDDEN)),
            Linear(weight(INTER, HIDDEN)),
            Linear(weight(HIDDEN, INTER)),
        )
        shared_expert = SigmoidGatedSharedExpert(mlp, Linear(weight(1, HIDDEN)))
    return OffloadMoELayer(router, ResidentExperts(experts, loaded=True), 0, shared_expert)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tokens", [1, 5])
def test_unrounded_output_rounds_to_the_rounded_one(shared, tokens) -> None:
    layer = _layer(shared)
    x = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    for is_decode in (False, True):
        rounded = layer(x, is_decode)
        partial = layer(x, is_decode, rounded=False)
        assert rounded.dtype == torch.bfloat16 and rounded.shape == x.shape
        assert partial.shape == x.shape
        assert partial.dtype == (torch.bfloat16 if shared else torch.float32)
        assert torch.equal(partial.to(torch.bfloat16), rounded)
        if not shared:  # the partial is the unrounded sum, not its rounding
            assert not torch.equal(partial, rounded.float())
