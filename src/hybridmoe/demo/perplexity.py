"""Perplexity of a model and of a unigram baseline on the same tokens.

The text is cut into consecutive windows of at most `window` tokens, each scored as a fresh
sequence: every token but a window's first is predicted from the tokens before it in its
window. The unigram baseline scores exactly those target tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

LogitsFn = Callable[[list[int]], torch.Tensor]  # ids [T] -> logits [T, V]


def windows(ids: list[int], window: int) -> Iterator[list[int]]:
    """Consecutive slices of `ids` of `window` tokens (the last may be shorter), each >= 2."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) >= 2:
            yield chunk


def targets(ids: list[int], window: int) -> list[int]:
    """The tokens `model_perplexity` scores, in order."""
    return [t for chunk in windows(ids, window) for t in chunk[1:]]


def model_perplexity(
    logits: LogitsFn, ids: list[int], window: int, progress: bool = False
) -> float:
    nll, count = 0.0, 0
    chunks = list(windows(ids, window))
    for chunk in tqdm(chunks, desc="perplexity", unit="window", disable=not progress):
        log_probs = torch.log_softmax(logits(chunk)[:-1].float(), dim=-1)  # [T-1, V]
        target = torch.tensor(chunk[1:])[:, None]  # [T-1, 1]
        nll -= log_probs.gather(1, target).sum().item()
        count += len(chunk) - 1
    if count == 0:
        raise ValueError("no tokens to score: need at least 2")
    return math.exp(nll / count)


def unigram_perplexity(
    fit_ids: list[int], eval_ids: list[int], vocab_size: int, smoothing: float = 1.0
) -> float:
    """Perplexity on `eval_ids` of token frequencies counted on `fit_ids`, each count plus
    `smoothing` (add-one by default, so unseen tokens keep a probability)."""
    counts = torch.bincount(torch.tensor(fit_ids), minlength=vocab_size).double() + smoothing
    log_probs = torch.log(counts / counts.sum())  # [V]
    return math.exp(-log_probs[torch.tensor(eval_ids)].mean().item())
