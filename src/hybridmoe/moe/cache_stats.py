"""ExpertCacheStats: what the expert cache did with the routes it saw (per layer, or summed)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class ExpertCacheStats:
    routes: int = 0  # valid routes seen (ids >= 0)
    hits: int = 0  # routes whose expert was resident before the call
    fetched_routes: int = 0  # routes served by an expert fetched in the same call
    cpu_routes: int = 0  # routes rewritten to -1 (computed on the CPU)
    fetched: int = 0  # distinct experts planned for a copy into a slot
    evictions: int = 0  # resident experts replaced by this layer's fetches
    bytes_copied: int = 0  # counted when the copy is planned, fetched * expert_nbytes

    @property
    def hit_rate(self) -> float:
        """hits / routes; 0.0 before any route."""
        return self.hits / self.routes if self.routes else 0.0

    def add(self, other: ExpertCacheStats) -> None:
        """Accumulate `other` into self, field by field."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @classmethod
    def merged(cls, stats: list[ExpertCacheStats]) -> ExpertCacheStats:
        """A new total of `stats` (the inputs are not modified)."""
        total = cls()
        for s in stats:
            total.add(s)
        return total
