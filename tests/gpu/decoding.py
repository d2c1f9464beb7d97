"""Greedy decoding driven step by step through an engine's model, on the engine's device: for
tests that compare decode logits or look at resources between steps."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hybridmoe.engine import Engine
from hybridmoe.engine.kv_cache import KVCache


def greedy_steps(engine: Engine, prompt: list[int], steps: int) -> Iterator[torch.Tensor]:
    """Prefill `prompt`, then yield the float32 host logits [V] of `steps` greedy decode steps
    (the decode path, batch 1)."""
    model = engine.model
    cache = KVCache(model.cfg, 1, len(prompt) + steps + 1, model.dtype, model.device)
    batch = model.make_batch(torch.arange(len(prompt))[None], [0], cache)
    token = int(model.forward(torch.tensor([prompt]), batch).argmax())
    for i in range(steps):
        positions = torch.tensor([[len(prompt) + i]])
        batch = model.make_batch(positions, [0], cache, is_decode=True)
        logits = model.forward(torch.tensor([[token]]), batch)[0]  # [V]
        yield logits
        token = int(logits.argmax())


def decode_logits(engine: Engine, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """[len(prompts) * steps, V]: each prompt's greedy decode logits, one prompt at a time."""
    return torch.stack([row for p in prompts for row in greedy_steps(engine, p, steps)])
