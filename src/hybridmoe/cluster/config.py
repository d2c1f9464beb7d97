"""ClusterConfig: how many replicas `hybridmoe cluster` starts, how the router in front spreads
requests over them, and how failed replicas come back. Where the front listens and what each
replica accepts are ServerConfig's; what each replica loads is EngineConfig's."""

from __future__ import annotations

import math
from dataclasses import dataclass

# sglang-router's --policy values that route regular (not prefill/decode-split) workers
ROUTING_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 2  # `hybridmoe serve` processes started here, each on its own port
    # Routing: cache_aware keeps requests that share a prompt prefix on one replica (while
    # the replicas' loads stay balanced), so that replica's prefix cache answers them
    policy: str = "cache_aware"
    # Replica i listens on 127.0.0.1:(replica_base_port + i); 0: any free ports
    replica_base_port: int = 0
    stats_port: int = 0  # GET /v1/stats of every replica, on the front's host; 0: any free
    # `hybridmoe serve` replicas on other machines, fronted too but not supervised from here
    worker_urls: tuple[str, ...] = ()
    health_check_interval_s: int = 1  # the router probes each replica's /health this often
    restart_delay_s: float = 1.0  # a replica that exited is started again after this

    def __post_init__(self) -> None:
        object.__setattr__(self, "worker_urls", tuple(self.worker_urls))  # argparse: a list
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.replicas == 0 and not self.worker_urls:
            raise ValueError("replicas is 0 and no worker_urls: the router would front nothing")
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {ROUTING_POLICIES}, got {self.policy!r}")
        for name in ("replica_base_port", "stats_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.replica_base_port and self.replica_base_port + self.replicas > 65536:
            raise ValueError(f"replica_base_port {self.replica_base_port} leaves no room for "
                             f"{self.replicas} replicas")  # fmt: skip
        for url in self.worker_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker_urls: {url!r} is not an http:// or https:// URL")
        if self.health_check_interval_s < 1:
            raise ValueError(
                f"health_check_interval_s must be >= 1, got {self.health_check_interval_s}"
            )
        if not (math.isfinite(self.restart_delay_s) and self.restart_delay_s >= 0):
            raise ValueError(f"restart_delay_s must be >= 0 seconds, got {self.restart_delay_s}")
