"""GenerationStats: the counts and timings of generation, one type for a Scheduler's counters
since it started and for one Engine call's share of them."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from hybridmoe.engine.prefix_cache import PrefixCacheStats
from hybridmoe.moe.cache_stats import ExpertCacheStats


@dataclass
class GenerationStats:
    """A Scheduler counts into one of these from its start (Scheduler.stats() returns a
    snapshot); Engine.stats is one generate/stream call's share, `after.since(before)`."""

    requests_served: int = 0  # finished normally (stop or length)
    requests_failed: int = 0  # ended by an error
    requests_cancelled: int = 0  # dropped because the client went away
    requests_running: int = 0  # holding a KV-cache row at the snapshot
    requests_waiting: int = 0  # queued for a row at the snapshot
    prompt_tokens: int = 0  # of the prompts admitted
    cached_prompt_tokens: int = 0  # of those, held by the prefix cache (not prefilled)
    completion_tokens: int = 0  # sampled, by prefill and decode steps
    decode_tokens: int = 0  # sampled by decode steps (a request's first token comes from prefill)
    decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # The expert cache over the decode steps since the MoE runtime's stats were last reset (at
    # the scheduler's start, and at the start of each Engine call); None when unused.
    experts: ExpertCacheStats | None = None
    prefix_cache: PrefixCacheStats | None = None  # since the start; None when off

    @property
    def prefill_tok_per_s(self) -> float:
        """Prompt tokens prefilled (those the prefix cache held excluded) per prefill second."""
        computed = self.prompt_tokens - self.cached_prompt_tokens
        return computed / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_per_s(self) -> float:
        """Aggregate decode throughput while decoding: tokens of all requests per step second."""
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def mean_batch(self) -> float:
        """Average number of sequences one decode step advanced."""
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    def since(self, earlier: GenerationStats) -> GenerationStats:
        """What was counted between `earlier`, a snapshot of the same counters, and this one;
        the requests running and waiting and `experts` as in this snapshot; `prefix_cache`'s
        blocks as in this snapshot, its hit and queried tokens counted since `earlier`."""
        counts = {name: getattr(self, name) - getattr(earlier, name) for name in _COUNTERS}
        prefix, before = self.prefix_cache, earlier.prefix_cache
        if prefix is not None and before is not None:
            counts["prefix_cache"] = replace(
                prefix,
                hit_tokens=prefix.hit_tokens - before.hit_tokens,
                queried_tokens=prefix.queried_tokens - before.queried_tokens,
            )
        return replace(self, **counts)

    def summary(self) -> str:
        line = (
            f"prompt tokens: {self.prompt_tokens}{self._cached_summary()} | "
            f"prefill: {self.prefill_tok_per_s:.1f} tok/s | "
            f"decode: {self.decode_tok_per_s:.1f} tok/s ({self.decode_tokens} tokens)"
        )
        return line + self._expert_summary()

    def _cached_summary(self) -> str:
        cached = self.cached_prompt_tokens
        return f" ({cached} from the prefix cache)" if cached else ""

    def _expert_summary(self) -> str:
        e, tokens = self.experts, max(self.decode_tokens, 1)
        if e is None:
            return ""
        cpu_share = e.cpu_routes / e.routes if e.routes else 0.0
        return (
            f" | expert cache hit rate: {e.hit_rate:.1%} | CPU routes: {cpu_share:.1%} | "
            f"fetched/token: {e.fetched / tokens:.2f} | "
            f"copied/token: {e.bytes_copied / tokens / 2**20:.2f} MiB"
        )


_SNAPSHOT_ONLY = ("requests_running", "requests_waiting", "experts", "prefix_cache")
_COUNTERS = tuple(f.name for f in fields(GenerationStats) if f.name not in _SNAPSHOT_ONLY)
