"""Routing realism: how skewed and how sticky a model's expert choices are, against a random router.

Runs the model (our engine, float32) on held-out standard library source and prints, per MoE
layer:
- entropy/uniform: entropy of the experts' shares of all routes over log(E); 1.00 is every
  expert used equally, lower is skewed;
- top share: the busiest expert's share of the routes (uniform: 1/E);
- P(reuse): the probability that an expert a token routes to is routed to by the next token
  too (independent uniform choices: K/E).
The same figures follow for a random router: each layer's gate re-drawn from a normal
distribution with the trained gate's standard deviation, every other weight unchanged. Cache
policies are judged on traces like the trained model's; on the random router's, every policy
looks the same.

Run: python scripts/routing_stats.py [--model DIR] [--tokens N]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from hybridmoe.config.model import ModelConfig
from hybridmoe.demo import demo_checkpoint_dir
from hybridmoe.demo.corpus import encode_files, split_corpus
from hybridmoe.demo.perplexity import windows
from hybridmoe.engine import Engine, EngineConfig
from hybridmoe.layers.linear import Linear
from hybridmoe.models.transformer import MoeCausalLM
from hybridmoe.moe.routing import route

MAX_WINDOW = 512


class RecordingRouter:
    """Stands in for a layer's router: returns the router's logits unchanged and keeps them."""

    def __init__(self, router: Linear):
        self.router = router
        self.logits: list[torch.Tensor] = []  # one [T, E] per call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        self.logits.append(logits)
        return logits


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=demo_checkpoint_dir())
    parser.add_argument("--tokens", type=int, default=16384, help="held-out tokens to route")
    parser.add_argument("--seed", type=int, default=0, help="for the random router")
    return parser.parse_args()


def routes(model: MoeCausalLM, ids: list[int]) -> list[list[torch.Tensor]]:
    """Per MoE layer, the top-k expert ids [T, K] of each window of `ids`, by running `model`."""
    window = min(model.cfg.max_position_embeddings, MAX_WINDOW)
    layers = model.moe_layers
    recorders = [RecordingRouter(layer.router) for layer in layers]
    for layer, recorder in zip(layers, recorders, strict=True):
        layer.router = recorder
    try:
        for chunk in windows(ids, window):
            model.logits(chunk)  # each MoE layer routes the window's tokens in one call
    finally:
        for layer, recorder in zip(layers, recorders, strict=True):
            layer.router = recorder.router
    top_k, norm = model.cfg.top_k, model.cfg.norm_topk_prob
    return [[route(logits, top_k, norm)[0] for logits in r.logits] for r in recorders]


def layer_stats(topk_ids: list[torch.Tensor], num_experts: int) -> tuple[float, float, float]:
    """(entropy / log(E), top expert's share, P(reuse at t+1)) of one layer's routes."""
    counts = torch.bincount(torch.cat(topk_ids).flatten(), minlength=num_experts).double()
    shares = counts / counts.sum()  # [E]
    entropy = -(shares[shares > 0] * shares[shares > 0].log()).sum().item()
    # For every route of token t: does token t+1 route to the same expert?
    reused = [(ids[:-1, :, None] == ids[1:, None, :]).any(-1) for ids in topk_ids]  # [T-1, K]
    reuse = torch.cat(reused).double().mean().item()
    return entropy / math.log(num_experts), shares.max().item(), reuse


def randomise_routers(model: MoeCausalLM, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in model.moe_layers:
        trained = layer.router.weight
        weight = torch.randn(trained.shape, generator=gen) * trained.float().std()
        layer.router = Linear(weight.to(trained.dtype))


def print_table(trained: list, random: list, cfg: ModelConfig) -> None:
    experts, k = cfg.num_experts, cfg.top_k
    print(f"{'':>6} {'trained router':^32} | {'random router':^32}")
    header = f"{'entropy/uniform':>15} {'top share':>9} {'P(reuse)':>8}"
    print(f"{'layer':>6} {header}   {header}")
    for layer_id, ours, theirs in zip(cfg.moe_layer_ids, trained, random, strict=True):
        cells = [f"{e:>15.3f} {s:>9.3f} {r:>8.3f}" for e, s, r in (ours, theirs)]
        print(f"{layer_id:>6} {cells[0]}   {cells[1]}")
    means = [[sum(col) / len(col) for col in zip(*s, strict=True)] for s in (trained, random)]
    cells = [f"{e:>15.3f} {s:>9.3f} {r:>8.3f}" for e, s, r in means]
    print(f"{'mean':>6} {cells[0]}   {cells[1]}")
    uniform = f"top share {1 / experts:.3f}, P(reuse) {k / experts:.3f}"
    print(f"uniform: entropy/uniform 1.000, {uniform}")


def main() -> None:
    args = parse_args()
    with Engine.from_pretrained(args.model, EngineConfig(dtype="float32")) as engine:
        model, cfg = engine.model, engine.model.cfg
        ids = encode_files(engine.require_tokenizer().backend, split_corpus().held_out)
        ids = ids[: args.tokens]
        print(f"{len(ids):,} held-out tokens, {cfg.num_experts} experts, top-{cfg.top_k}")
        trained = [layer_stats(t, cfg.num_experts) for t in routes(model, ids)]
        randomise_routers(model, args.seed)
        random = [layer_stats(t, cfg.num_experts) for t in routes(model, ids)]
        print_table(trained, random, cfg)


if __name__ == "__main__":
    main()
