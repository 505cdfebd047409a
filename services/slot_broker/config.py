"""Configuration of the slot broker, read from the environment."""

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
    redis_from_env,
    require_positive,
)


@dataclass(frozen=True)
class Config:
    """Everything `python -m services.slot_broker` needs; `from_env` names any bad variable."""

    listen_addr: str = "0.0.0.0:50054"
    """SLOT_BROKER_LISTEN_ADDR: host:port the gRPC server binds ("127.0.0.1:0" in tests)."""
    redis_url: str = DEFAULT_REDIS_URL
    """REDIS_URL: the Redis holding the leases."""
    redis_prefix: str = DEFAULT_KEY_PREFIX
    """KVRS_REDIS_PREFIX: hash-tagged prefix of every key; broker replicas share it."""
    redis_tls: RedisTls = RedisTls()
    """KVRS_REDIS_TLS_CA_FILE / _CERT_FILE / _KEY_FILE: TLS material for a rediss:// Redis."""
    cluster_cap: int = 32
    """SLOT_BROKER_CLUSTER_CAP: concurrent migrations allowed cluster-wide."""
    link_cap: int = 0
    """SLOT_BROKER_LINK_CAP: concurrent migrations allowed per (src, dst) pair; 0 = no cap."""
    lease_ttl_s: float = 10.0
    """SLOT_BROKER_LEASE_TTL_S: lease lifetime when the request gives none; a crashed
    holder's slot returns at most this long after its last renewal."""
    max_lease_ttl_s: float = 600.0
    """SLOT_BROKER_MAX_LEASE_TTL_S: longest lease a request may ask for."""
    purge_interval_s: float = 0.5
    """SLOT_BROKER_PURGE_INTERVAL_S: how often expired leases are dropped when idle (every
    call drops them too)."""
    metrics_addr: str = ""
    """KVRS_METRICS_ADDR: host:port of the Prometheus endpoint; empty = off."""
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    """TLS, message size and shutdown grace (KVRS_TLS_*, KVRS_MAX_MESSAGE_BYTES, ...)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        redis_url, redis_prefix, redis_tls = redis_from_env(env)
        config = cls(
            listen_addr=env_str("SLOT_BROKER_LISTEN_ADDR", "0.0.0.0:50054", env),
            redis_url=redis_url,
            redis_prefix=redis_prefix,
            redis_tls=redis_tls,
            cluster_cap=env_int("SLOT_BROKER_CLUSTER_CAP", 32, env),
            link_cap=env_int("SLOT_BROKER_LINK_CAP", 0, env),
            lease_ttl_s=env_float("SLOT_BROKER_LEASE_TTL_S", 10.0, env),
            max_lease_ttl_s=env_float("SLOT_BROKER_MAX_LEASE_TTL_S", 600.0, env),
            purge_interval_s=env_float("SLOT_BROKER_PURGE_INTERVAL_S", 0.5, env),
            metrics_addr=env_str("KVRS_METRICS_ADDR", "", env),
            grpc=GrpcSettings.from_env(env),
        )
        require_positive(
            ("SLOT_BROKER_CLUSTER_CAP", config.cluster_cap),
            ("SLOT_BROKER_LEASE_TTL_S", config.lease_ttl_s),
            ("SLOT_BROKER_MAX_LEASE_TTL_S", config.max_lease_ttl_s),
            ("SLOT_BROKER_PURGE_INTERVAL_S", config.purge_interval_s),
        )
        if config.link_cap < 0:
            raise ConfigError(f"SLOT_BROKER_LINK_CAP must be >= 0, got {config.link_cap}")
        if config.lease_ttl_s > config.max_lease_ttl_s:
            raise ConfigError("SLOT_BROKER_LEASE_TTL_S must not exceed SLOT_BROKER_MAX_LEASE_TTL_S")
        return config
