"""Random routing traces for the planning tests."""

from __future__ import annotations

import numpy as np

from hybridmoe.planning.trace import RoutingTrace


def random_trace(
    seed: int, layers: int, experts: int, top_k: int, steps: int, rows: int = 1, skew: float = 1.0
) -> RoutingTrace:
    """`steps` decode steps of `rows` tokens; each row routes to `top_k` distinct experts per
    layer, drawn with Zipf-like weights (exponent `skew`; 0 = uniform)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1) ** skew
    p /= p.sum()
    ids = np.empty((steps * rows, layers, top_k), np.int16)
    for r in range(steps * rows):
        for layer in range(layers):
            ids[r, layer] = rng.choice(experts, top_k, replace=False, p=rng.permutation(p))
    weights = np.full(ids.shape, 1.0 / top_k, np.float16)
    step = np.repeat(np.arange(steps, dtype=np.int32), rows)
    return RoutingTrace(ids, weights, step, experts)
