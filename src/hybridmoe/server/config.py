"""ServerConfig: where `hybridmoe serve` listens, whom it answers, how much it accepts and how
it shuts down. How long a sequence may grow is the engine's (EngineConfig.max_seq_len): the KV
cache is the engine's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.server.reasoning import AUTO, NONE, REASONING_FORMATS

MIB = 2**20
REASONING_FORMAT_CHOICES = (AUTO, NONE, *REASONING_FORMATS)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback only unless asked otherwise
    port: int = 8000  # 0: any free port (the URL printed on start names it)
    shutdown_timeout_s: float = 5.0  # after SIGINT/SIGTERM, how long open streams may go on
    # Bearer token every /v1 request must carry; None: no authentication (/health, /metrics
    # stay open either way)
    api_key: str | None = None
    # A file whose first line is that token (kept out of the process list, unlike --api-key)
    api_key_file: str | None = None
    # Host header names accepted (DNS rebinding); (): the bound host, plus localhost,
    # 127.0.0.1 and [::1] when that is a loopback address; "*": any (security.py)
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 4 * MIB  # larger request bodies get 413 before they are read
    max_queue: int | None = None  # requests waiting for a KV row beyond which 503; None: no cap
    request_timeout_s: float | None = None  # a request still running after this is cancelled
    # A request's headers and body must arrive within this many seconds of its first byte (of
    # the connection, for its first request): half-sent requests do not hold connections
    read_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1024  # beyond this many open connections, requests get 503
    # How chat replies' reasoning becomes reasoning_content (reasoning.py); auto: by the
    # checkpoint's chat template (harmony when it writes <|channel|>, think when <think>)
    reasoning_format: str = AUTO

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key_file is not None:
            if self.api_key is not None:
                raise ValueError("give api_key or api_key_file, not both")
            object.__setattr__(self, "api_key", read_api_key(self.api_key_file))
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it out for no authentication)")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))  # argparse: a list
        if any(not name for name in self.allowed_hosts):
            raise ValueError("allowed_hosts must not contain an empty name")
        for name in ("max_body_bytes", "max_queue", "max_connections"):
            _check_positive_int(name, getattr(self, name))
        for name in ("request_timeout_s", "read_timeout_s", "keep_alive_timeout_s"):
            _check_positive_seconds(name, getattr(self, name))
        if self.reasoning_format not in REASONING_FORMAT_CHOICES:
            raise ValueError(
                f"reasoning_format must be one of {', '.join(REASONING_FORMAT_CHOICES)}, "
                f"got {self.reasoning_format!r}"
            )
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")


def _check_positive_int(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_positive_seconds(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value}")


def read_api_key(path: str) -> str:
    """The first line of `path`, stripped; ValueError naming the file if it cannot be read or
    that line is empty."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"api_key_file {path!r} cannot be read: {error}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise ValueError(f"api_key_file {path!r}: its first line is empty")
    return key
