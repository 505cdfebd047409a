"""Configuration of the gossip service, read from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_REDIS_URL,
    ConfigError,
    GrpcSettings,
    RedisTls,
    env_float,
    env_int,
    env_str,
    is_cluster_url,
    redis_from_env,
    require_positive,
)

CLUSTER_SHARDS = 16
"""Registry shards on a Redis Cluster unless set: enough hash tags to spread evenly over
a few primaries, few enough that a listing's per-shard reads stay cheap."""


@dataclass(frozen=True)
class Config:
    """Everything `python -m services.gossip` needs; `from_env` names any bad variable."""

    listen_addr: str = "0.0.0.0:50051"
    """GOSSIP_LISTEN_ADDR: host:port the gRPC server binds ("127.0.0.1:0" in tests)."""
    redis_url: str = DEFAULT_REDIS_URL
    """REDIS_URL: the Redis holding the registry (redis://, rediss://, with AUTH), or a
    Redis Cluster (redis+cluster://host:port,host:port, rediss+cluster://)."""
    redis_prefix: str = DEFAULT_KEY_PREFIX
    """KVRS_REDIS_PREFIX: hash-tagged prefix of every key; replicas share it."""
    redis_tls: RedisTls = RedisTls()
    """KVRS_REDIS_TLS_CA_FILE / _CERT_FILE / _KEY_FILE: TLS material for a rediss:// Redis."""
    registry_shards: int = 1
    """GOSSIP_REGISTRY_SHARDS: hash tags the registry is spread over (instance `id` in shard
    crc32(id) % N, keys under `{<tag>.<shard>}:`), so a Redis Cluster spreads it over its
    primaries; every replica must use the same number. Default: 16 with a
    redis+cluster:// REDIS_URL, else 1."""
    heartbeat_ttl_s: float = 2.0
    """GOSSIP_HEARTBEAT_TTL_S: silence after which an instance becomes suspect (no new
    placements), unless it registered with its own TTL."""
    confirm_ttls: float = 2.0
    """GOSSIP_CONFIRM_TTLS: how many more of its TTLs a suspect instance has to heartbeat
    again before it is declared failed (its streams then move), unless a direct probe
    finds nothing listening at its address first; 0 = failed at the first missed TTL."""
    sweep_interval_s: float = 0.1
    """GOSSIP_SWEEP_INTERVAL_S: how often expired instances are looked for; a failure is
    reported at most this long after its TTL."""
    events_maxlen: int = 10_000
    """GOSSIP_EVENTS_MAXLEN: events retained for replay (approximate stream MAXLEN)."""
    changes_maxlen: int = 100_000
    """GOSSIP_CHANGES_MAXLEN: change entries retained for views following ListChanges
    (approximate stream MAXLEN); a view further behind gets a full listing."""
    down_retention_s: float = 600.0
    """GOSSIP_DOWN_RETENTION_S: how long failed/left instances stay listable and link
    samples are kept."""
    metrics_addr: str = ""
    """KVRS_METRICS_ADDR: host:port of the Prometheus endpoint; empty = off."""
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    """TLS, message size and shutdown grace (KVRS_TLS_*, KVRS_MAX_MESSAGE_BYTES, ...)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        redis_url, redis_prefix, redis_tls = redis_from_env(env)
        config = cls(
            listen_addr=env_str("GOSSIP_LISTEN_ADDR", "0.0.0.0:50051", env),
            redis_url=redis_url,
            redis_prefix=redis_prefix,
            redis_tls=redis_tls,
            registry_shards=env_int(
                "GOSSIP_REGISTRY_SHARDS", CLUSTER_SHARDS if is_cluster_url(redis_url) else 1, env
            ),
            heartbeat_ttl_s=env_float("GOSSIP_HEARTBEAT_TTL_S", 2.0, env),
            confirm_ttls=env_float("GOSSIP_CONFIRM_TTLS", 2.0, env),
            sweep_interval_s=env_float("GOSSIP_SWEEP_INTERVAL_S", 0.1, env),
            events_maxlen=env_int("GOSSIP_EVENTS_MAXLEN", 10_000, env),
            changes_maxlen=env_int("GOSSIP_CHANGES_MAXLEN", 100_000, env),
            down_retention_s=env_float("GOSSIP_DOWN_RETENTION_S", 600.0, env),
            metrics_addr=env_str("KVRS_METRICS_ADDR", "", env),
            grpc=GrpcSettings.from_env(env),
        )
        if not 0 <= config.confirm_ttls <= 100:
            raise ConfigError(f"GOSSIP_CONFIRM_TTLS must be in [0, 100], got {config.confirm_ttls}")
        require_positive(
            ("GOSSIP_REGISTRY_SHARDS", config.registry_shards),
            ("GOSSIP_HEARTBEAT_TTL_S", config.heartbeat_ttl_s),
            ("GOSSIP_SWEEP_INTERVAL_S", config.sweep_interval_s),
            ("GOSSIP_EVENTS_MAXLEN", config.events_maxlen),
            ("GOSSIP_CHANGES_MAXLEN", config.changes_maxlen),
            ("GOSSIP_DOWN_RETENTION_S", config.down_retention_s),
        )
        return config
