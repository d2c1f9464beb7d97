"""GenerationStats: counts and timings of one generate call."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0  # tokens produced by decode steps (the first comes from prefill)
    decode_s: float = 0.0

    @property
    def prefill_tok_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    def summary(self) -> str:
        return (
            f"prompt tokens: {self.prompt_tokens} | "
            f"prefill: {self.prefill_tok_per_s:.1f} tok/s | "
            f"decode: {self.decode_tok_per_s:.1f} tok/s ({self.decode_tokens} tokens)"
        )
