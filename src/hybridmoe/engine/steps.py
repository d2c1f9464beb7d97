"""The two forward steps generation is made of: prefill one prompt into a KV-cache row, and
decode one token for each of several sequences, each in its own row at its own position.

The Scheduler, the one generation loop, drives these.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from hybridmoe import env
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.engine.sampling import sample_batch
from hybridmoe.engine.sequence import Sequence
from hybridmoe.kernels.threads import serial_torch_ops
from hybridmoe.models.transformer import MoeCausalLM


def prefill(
    model: MoeCausalLM, seq: Sequence, row: int, cache: KVCache, cached_tokens: int = 0
) -> str:
    """Write `seq`'s prompt into KV row `row` from position `cached_tokens` and sample its
    first token; positions below `cached_tokens` (< the prompt's length) must already hold the
    prompt's KV there (the prefix cache put them there).

    Returns the text that token makes printable. Whatever a previous occupant left in the row
    beyond the prompt is never read: every query attends to positions <= its own only.
    """
    ids = torch.tensor([seq.prompt_ids[cached_tokens:]])  # [1, T - cached_tokens]
    positions = torch.arange(cached_tokens, len(seq.prompt_ids))[None]  # [1, T - cached_tokens]
    batch = model.make_batch(positions, [row], cache)
    logits = model.forward(ids, batch)  # [1, V]
    return seq.append(sample_batch(logits, [seq.sampler])[0])


def decode(model: MoeCausalLM, rows: list[int], seqs: list[Sequence], cache: KVCache) -> list[str]:
    """One new token for each unfinished `seqs[i]`, whose KV cache is row `rows[i]`.

    Returns each sequence's printable text delta, in the order of `seqs`.
    """
    ids = torch.tensor([[seq.output_ids[-1]] for seq in seqs])  # [B, 1]
    starts = tuple(seq.next_position for seq in seqs)
    positions = torch.tensor([[p] for p in starts])  # [B, 1]
    batch = model.make_batch(positions, rows, cache, is_decode=True, starts=starts)
    # on the cpu device the numba kernels take every core; torch's few small ops take one
    with serial_torch_ops() if model.device.type == "cpu" and env.serial_torch() else nullcontext():
        logits = model.forward(ids, batch)  # [B, V]
    tokens = sample_batch(logits, [seq.sampler for seq in seqs])
    return [seq.append(token) for seq, token in zip(seqs, tokens, strict=True)]
