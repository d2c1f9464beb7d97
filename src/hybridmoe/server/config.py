"""ServerConfig: where `hybridmoe serve` listens and how it shuts down. How long a sequence
may grow is the engine's (EngineConfig.max_seq_len): the KV cache is the engine's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback only unless asked otherwise
    port: int = 8000  # 0: any free port (the URL printed on start names it)
    shutdown_timeout_s: float = 5.0  # after SIGINT/SIGTERM, how long open streams may go on

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
