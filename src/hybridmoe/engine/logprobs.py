"""Per-token log-probabilities, as OpenAI's and vLLM's APIs report them.

Contract: a token's logprob is log_softmax, in float32, of the raw model logits of the step that
produced it: before temperature, top-k/top-p and any grammar mask, so it does not depend on how
the token was picked (vLLM's default `raw_logprobs`). The `top` alternatives are the `top_n`
most likely tokens of that same distribution, most likely first (ties: lower id first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; /v1/completions allows 5


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of one generated token and of the `top_n` most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def token_logprobs(logits: Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """The TokenLogprob of `token_id` under `logits` [V] (raw model logits, any float dtype)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        # A stable descending sort puts tied logprobs in id order, whatever the device.
        values, ids = torch.sort(logprobs, descending=True, stable=True)
        top = tuple(zip(ids[:top_n].tolist(), values[:top_n].tolist(), strict=True))
    return TokenLogprob(token_id, float(logprobs[token_id]), top)
