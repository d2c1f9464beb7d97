"""The two forward steps generation is made of: prefill one prompt into a KV-cache row, and
decode one token for each of several sequences, each in its own row at its own position.

The Scheduler, the one generation loop, drives these.
"""

from __future__ import annotations

import torch

from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.engine.sampling import sample_batch
from hybridmoe.engine.sequence import Sequence
from hybridmoe.models.transformer import MoeCausalLM


def prefill(model: MoeCausalLM, seq: Sequence, row: int, cache: KVCache) -> str:
    """Write `seq`'s prompt into KV row `row` from position 0 and sample its first token.

    Returns the text that token makes printable. Whatever a previous occupant left in the row
    beyond the prompt is never read: every query attends to positions <= its own only.
    """
    ids = torch.tensor([seq.prompt_ids])  # [1, T]
    batch = model.make_batch(torch.arange(ids.shape[1])[None], [row], cache)
    logits = model.forward(ids, batch)  # [1, V]
    return seq.append(sample_batch(logits, [seq.sampler])[0])


def decode(model: MoeCausalLM, rows: list[int], seqs: list[Sequence], cache: KVCache) -> list[str]:
    """One new token for each unfinished `seqs[i]`, whose KV cache is row `rows[i]`.

    Returns each sequence's printable text delta, in the order of `seqs`.
    """
    ids = torch.tensor([[seq.output_ids[-1]] for seq in seqs])  # [B, 1]
    positions = torch.tensor([[seq.next_position] for seq in seqs])  # [B, 1]
    batch = model.make_batch(positions, rows, cache, is_decode=True)
    logits = model.forward(ids, batch)  # [B, V]
    tokens = sample_batch(logits, [seq.sampler for seq in seqs])
    return [seq.append(token) for seq, token in zip(seqs, tokens, strict=True)]
