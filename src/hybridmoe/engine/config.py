"""EngineConfig: how the engine loads and runs a checkpoint. CLI defaults come from here."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridmoe.moe.config import OffloadConfig

DTYPE_CHOICES = ("auto", "bfloat16", "float32")


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "auto"  # auto: bfloat16 for bf16 checkpoints, float32 otherwise
    threads: int | None = None  # torch intra-op threads; None: torch's default
    max_batch: int = 16  # sequences decoded together
    progress: bool = False  # progress bar while loading weights
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # where experts decode

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
