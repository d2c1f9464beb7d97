"""Turning logits into token ids: per-request sampling parameters, logit masks and samplers.

The masks follow Hugging Face `transformers` (`TopKLogitsWarper`, `TopPLogitsWarper`) and are
applied in the same order: temperature -> top-k -> top-p -> softmax -> draw.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hybridmoe.engine.constraints import Grammar, TokenConstraint, mask_logits
from hybridmoe.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs

_MAX_SEED = 2**64  # torch.Generator.manual_seed accepts [0, 2**64)
# Below this temperature sampling is greedy (vLLM's threshold): dividing float32 logits by a
# tinier one overflows (1e-300 is 0 in float32: 0/0 = nan) or leaves only the argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    `temperature` below GREEDY_BELOW_TEMPERATURE (0 included) means greedy (argmax);
    `top_k == 0` and `top_p == 1.0` switch those masks off. `stop` strings end generation and
    are never part of the output; a single string or a list is accepted and stored as a tuple.
    With `seed` set, the request's tokens depend only on its own logits, never on what other
    requests in the batch do.

    `logprobs` (None: off) records each token's logprob and that many top alternatives
    (0..20; see engine/logprobs.py for what is reported). With `grammar` every token is picked
    from the tokens the grammar allows (the logits of the others are -inf before temperature,
    top-k and top-p); the output ends with EOS once the grammar is complete, so `ignore_eos`
    cannot go with it.

    `stop_token_ids` end generation as EOS does (never part of the text, ignored with
    `ignore_eos`): a chat format's end-of-reply tokens that the checkpoint may not list as EOS.
    `skip_special_tokens` False keeps special tokens in the text (a format that reads them).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: Grammar | None = field(default=None, repr=False)
    stop_token_ids: frozenset[int] = frozenset()
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_temperature(self.temperature)
        _check_int("top_k", self.top_k, minimum=0)
        _check_top_p(self.top_p)
        _check_seed(self.seed)
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise ValueError(f"logprobs must be <= {MAX_TOP_LOGPROBS}, got {self.logprobs}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(f"grammar must be a Grammar or None, got {self.grammar!r}")
        if self.grammar is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a grammar (it ends with EOS)")
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        for token in self.stop_token_ids:
            _check_int("stop_token_ids entries", token, minimum=0)
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(
                f"skip_special_tokens must be True or False, got {self.skip_special_tokens!r}"
            )

    @property
    def greedy(self) -> bool:
        """True when every token is the argmax of its logits (temperature ~0)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_temperature(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"temperature must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {value}")


def _check_top_p(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"top_p must be a number, got {value!r}")
    if not 0.0 < value <= 1.0:  # also rejects NaN
        raise ValueError(f"top_p must be in (0, 1], got {value}")


def _check_seed(value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"seed must be an integer or None, got {value!r}")
    if not 0 <= value < _MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**64), got {value}")


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
    return tuple(stop)


def apply_top_k(logits: Tensor, k: int) -> Tensor:
    """Keep the `k` largest logits of each row, set the rest to -inf.

    logits: [B, V] (or [V]). Returns a new tensor of the same shape and dtype; the input is not
    modified. Entries tied with the k-th largest are kept, so a row may keep more than `k`.
    `k == 0` or `k >= V` returns the input unchanged.
    """
    if k < 0:
        raise ValueError(f"top_k must be >= 0, got {k}")
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # [B, 1]
    return logits.masked_fill(logits < kth_largest, -math.inf)


def apply_top_p(logits: Tensor, p: float) -> Tensor:
    """Nucleus mask: keep the smallest set of most likely tokens whose probability sums to >= p.

    logits: [B, V] (or [V]). Returns a new tensor with the other entries set to -inf; the input
    is not modified. The most likely token is always kept. Same semantics (and tie order) as
    Hugging Face `TopPLogitsWarper`: a token is dropped when the total probability of the
    tokens ranked at or below it is <= 1 - p. `p == 1` returns the input unchanged.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    if p == 1.0:
        return logits
    sorted_logits, sorted_ids = torch.sort(logits, dim=-1, descending=False)  # [B, V]
    mass_at_or_below = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    drop_sorted = mass_at_or_below <= 1.0 - p
    drop_sorted[..., -1] = False  # the most likely token survives any p
    drop = drop_sorted.scatter(-1, sorted_ids, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, -math.inf)


class Sampler:
    """Samples one token at a time for one request, following its `SamplingParams`.

    Owns its random generator, seeded from `params.seed` (a fresh random seed, kept in
    `self.seed`, when None), so a seeded request draws the same tokens from the same logits no
    matter what other requests do. With a `constraint` (the state of `params.grammar`) it picks
    among the tokens the constraint allows and advances it with each pick. With
    `params.logprobs` set, `logprobs[i]` is the TokenLogprob of the i-th token it picked, from
    the raw logits it was given. Not thread-safe; use one sampler per request.
    """

    def __init__(self, params: SamplingParams, constraint: TokenConstraint | None = None) -> None:
        if (params.grammar is None) != (constraint is None):
            raise ValueError("a Sampler has a constraint exactly when its params have a grammar")
        self.params, self.constraint = params, constraint
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generators: dict[torch.device, torch.Generator] = {}
        self.logprobs: list[TokenLogprob] = []

    @property
    def plain(self) -> bool:
        """Greedy with nothing else to do per token: sample_batch's one-argmax fast path."""
        return self.params.greedy and self.constraint is None and self.params.logprobs is None

    def sample(self, logits: Tensor) -> int:
        """Pick a token id from `logits` [V] (any float dtype; maths in float32)."""
        if logits.dim() != 1:
            raise ValueError(
                f"Sampler.sample expects logits of shape [V], got {list(logits.shape)}"
            )
        raw = logits
        if self.constraint is not None:
            logits = mask_logits(logits, self.constraint.allowed())
        token = self._pick(logits)
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.params.logprobs is not None:
            self.logprobs.append(token_logprobs(raw, token, self.params.logprobs))
        return token

    def _pick(self, logits: Tensor) -> int:
        if self.params.greedy:
            return int(logits.argmax())
        probs = self.probabilities(logits)  # [V]
        token = torch.multinomial(probs, 1, generator=self._generator(probs.device))
        return int(token)

    def probabilities(self, logits: Tensor) -> Tensor:
        """The distribution `sample` draws from: float32 [V], zero outside the top-k/top-p set."""
        params = self.params
        # Subtracting the max first keeps a tiny temperature from overflowing to inf.
        logits = logits.float()
        scaled = (logits - logits.max()) / params.temperature  # [V]
        masked = apply_top_p(apply_top_k(scaled, params.top_k), params.top_p)
        return masked.softmax(dim=-1)

    def _generator(self, device: torch.device) -> torch.Generator:
        # torch.multinomial needs a generator on the same device as its input.
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return self._generators[device]


def sample_batch(logits: Tensor, samplers: Sequence[Sampler]) -> list[int]:
    """Pick one token per row: row b of `logits` [B, V] with `samplers[b]`.

    When every sampler is plain (greedy, no grammar, no logprobs) this is a single argmax over
    the batch: numpy's over host float32 logits (the first maximum, a NaN counting as the
    maximum, as torch.argmax picks: tests/engine/test_sampling.py), which costs a decode step
    a few µs where torch's op and its tolist took ~50 on the step's cold caches.
    """
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(
            f"sample_batch needs logits of shape [B, V] with B == len(samplers) = "
            f"{len(samplers)}, got {list(logits.shape)}"
        )
    if all(s.plain for s in samplers):
        if logits.dtype is torch.float32 and logits.is_cpu:
            return logits.numpy().argmax(axis=-1).tolist()
        return logits.argmax(dim=-1).tolist()
    return [sampler.sample(row) for sampler, row in zip(samplers, logits, strict=True)]
