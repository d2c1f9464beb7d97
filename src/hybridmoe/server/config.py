"""ServerConfig: where `hybridmoe serve` listens and how long a sequence may grow."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_SEQ_LEN = 4096  # KV positions per request when the model allows more


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback only unless asked otherwise
    port: int = 8000  # 0: any free port (the URL printed on start names it)
    # KV-cache positions per request (prompt + completion); None: the model's context window,
    # capped at DEFAULT_MAX_SEQ_LEN. The cache holds max_batch rows of this many positions.
    max_seq_len: int | None = None
    shutdown_timeout_s: float = 5.0  # after SIGINT/SIGTERM, how long open streams may go on

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")

    def resolve_max_seq_len(self, context_window: int) -> int:
        """max_seq_len for a model whose context window is `context_window` positions."""
        if self.max_seq_len is None:
            return min(context_window, DEFAULT_MAX_SEQ_LEN)
        if self.max_seq_len > context_window:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} exceeds the model's context window "
                f"({context_window} positions)"
            )
        return self.max_seq_len
