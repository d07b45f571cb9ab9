"""WorkerConfig: every knob of the worker's Redis side (the engine has its own EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from producer.connection import NO_REPLICA_WAIT_ON_CLUSTER, parse
from producer.limits import Limits
from producer.protocol import DEFAULT_PREFIX, MAX_SHARDS, validate_name


@dataclass(frozen=True)
class WorkerConfig:
    redis_url: str
    served_model_name: str
    name: str
    prefix: str = DEFAULT_PREFIX
    device: str = "cpu"
    heartbeat_ttl: float = 10.0  # seconds; after that a silent worker's jobs may be reclaimed
    reclaim_interval: float = 5.0  # seconds between scans for dead workers' pending jobs
    max_attempts: int = 3  # deliveries of one entry before it is dead-lettered
    result_ttl: int = 3600  # seconds a reply stream lives after its last event
    dead_ttl: int = 7 * 24 * 3600  # dead-letter stream TTL, refreshed on each dead letter
    stream_ttl: int = 7 * 24 * 3600  # job stream TTL, refreshed by heartbeats and submits
    drain_timeout: float = 30.0  # SIGTERM: seconds to finish in-flight work before handing back
    flush_timeout: float = 15.0  # then seconds for Redis to take the last writes before exiting
    block_ms: int = 500  # XREADGROUP BLOCK when idle
    cancel_poll_interval: float = 1.0  # seconds between cancel-key sweeps (pub/sub can miss)
    limits: Limits = field(default_factory=Limits)
    metrics_port: int = 0  # Prometheus /metrics on this port; 0 = off
    metrics_host: str = "0.0.0.0"
    stream_interval: int = 1  # tokens per sequence per tokens event (the first goes at once)
    # token writes from a child process (its own GIL), or a thread
    writer: Literal["process", "thread"] = "process"
    min_replicas: int = 0  # writes that end jobs wait until this many replicas hold them
    shards: int = 1  # the model's queue shards (producer/shards.py); this worker reads them all

    def __post_init__(self) -> None:
        validate_name(self.served_model_name, "served model name")
        validate_name(self.name, "worker name")
        validate_name(self.prefix, "key prefix")
        if self.heartbeat_ttl <= 0.1:
            raise ValueError(f"--heartbeat-ttl must be above 0.1 s, got {self.heartbeat_ttl}")
        if self.reclaim_interval <= 0:
            raise ValueError(f"--reclaim-interval must be positive, got {self.reclaim_interval}")
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be at least 1, got {self.max_attempts}")
        for name in ("result_ttl", "dead_ttl", "stream_ttl"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 second, got {getattr(self, name)}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        if self.flush_timeout < 0:
            raise ValueError(f"--flush-timeout must be >= 0, got {self.flush_timeout}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0 (off) or a TCP port, got "
                             f"{self.metrics_port}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1 token, got "
                             f"{self.stream_interval}")
        if self.writer not in ("thread", "process"):
            raise ValueError(f"--writer must be 'thread' or 'process', got {self.writer!r}")
        if self.min_replicas < 0:
            raise ValueError(f"--min-replicas must be >= 0, got {self.min_replicas}")
        if self.min_replicas and parse(self.redis_url).is_cluster:
            raise ValueError(f"--min-replicas: {NO_REPLICA_WAIT_ON_CLUSTER}")
        if not 1 <= self.shards < MAX_SHARDS:
            raise ValueError(f"--shards must be in [1, {MAX_SHARDS}), got {self.shards}")
        if self.block_ms < 1:
            raise ValueError(f"block_ms must be at least 1, got {self.block_ms}")

    @property
    def heartbeat_interval(self) -> float:
        return self.heartbeat_ttl / 4
