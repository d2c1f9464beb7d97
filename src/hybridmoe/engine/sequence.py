"""Sequence: one request's tokens, sampler, and streamed text while it is generated."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridmoe.engine.constraints import TokenConstraint
from hybridmoe.engine.logprobs import TokenLogprob
from hybridmoe.engine.sampling import Sampler, SamplingParams
from hybridmoe.engine.stopping import StopStringMatcher


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    logprobs: list[TokenLogprob] | None = None  # one per token id when params.logprobs is set


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    max_len: int  # context limit: prompt + output never exceed it
    detokenizer: object | None = None  # IncrementalDecoder; None: ids only
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    constraint: TokenConstraint | None = None  # the state of params.grammar, if it has one

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params, self.constraint)
        self.stop_matcher = StopStringMatcher(self.params.stop)
        self._logprobs_taken = 0

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The TokenLogprobs of the tokens sampled since the last call (() when not asked)."""
        new = self.sampler.logprobs[self._logprobs_taken :]
        self._logprobs_taken += len(new)
        return tuple(new)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def next_position(self) -> int:
        """Position of the last sampled token, the input of the next decode step."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    def append(self, token: int) -> str:
        """Record a sampled token; returns the text it makes printable (after stop handling)."""
        self.output_ids.append(token)
        ends = token in self.eos_ids or token in self.params.stop_token_ids
        if ends and not self.params.ignore_eos:
            self.finish_reason = "stop"
            delta = self._flush()
        else:
            delta, stopped = self._feed_text(token)
            if stopped:
                self.finish_reason = "stop"
            elif self._at_length_limit():
                self.finish_reason = "length"
                delta += self._flush()
        self.text += delta
        return delta

    def _feed_text(self, token: int) -> tuple[str, bool]:
        if self.detokenizer is None:
            return "", False
        return self.stop_matcher.feed(self.detokenizer.feed(token))

    def _at_length_limit(self) -> bool:
        at_max = len(self.output_ids) >= self.params.max_tokens
        return at_max or len(self.prompt_ids) + len(self.output_ids) >= self.max_len

    def _flush(self) -> str:
        if self.detokenizer is None:
            return ""
        tail, stopped = self.stop_matcher.feed(self.detokenizer.flush())
        return tail if stopped else tail + self.stop_matcher.flush()

    def completion(self) -> Completion:
        logprobs = self.sampler.logprobs if self.params.logprobs is not None else None
        reason = self.finish_reason or ""
        return Completion(self.prompt_ids, self.output_ids, self.text, reason, logprobs)
