"""Configuration of the cost oracle, read from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common import GrpcSettings, env_float, env_str, require_positive
from services.common.decision_inputs import InputsConfig


@dataclass(frozen=True)
class Config:
    """Everything `python -m services.cost_oracle` needs; `from_env` names any bad variable."""

    listen_addr: str = "0.0.0.0:50052"
    """COST_ORACLE_LISTEN_ADDR: host:port the gRPC server binds ("127.0.0.1:0" in tests)."""
    gossip_addr: str = "127.0.0.1:50051"
    """GOSSIP_ADDR: host:port of the gossip store (instances and link measurements)."""
    refresh_s: float = 0.5
    """COST_ORACLE_REFRESH_S: how often link estimates and instances are re-read."""
    peer_timeout_s: float = 5.0
    """COST_ORACLE_PEER_TIMEOUT_S: deadline of each gossip call. Those calls refresh the
    view in the background (no answer waits for one), and at thousands of instances a
    loaded gossip needs seconds to list them: a shorter deadline leaves the view never
    refreshed."""
    inputs: InputsConfig = field(default_factory=InputsConfig)
    """KVRS_TOPOLOGY_FILE, KVRS_MODEL, KVRS_PROFILE_FILE, KVRS_TELEMETRY_STALE_AFTER_S."""
    metrics_addr: str = ""
    """KVRS_METRICS_ADDR: host:port of the Prometheus endpoint; empty = off."""
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    """TLS, message size and shutdown grace (KVRS_TLS_*, KVRS_MAX_MESSAGE_BYTES, ...)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        config = cls(
            listen_addr=env_str("COST_ORACLE_LISTEN_ADDR", "0.0.0.0:50052", env),
            gossip_addr=env_str("GOSSIP_ADDR", "127.0.0.1:50051", env),
            refresh_s=env_float("COST_ORACLE_REFRESH_S", 0.5, env),
            peer_timeout_s=env_float("COST_ORACLE_PEER_TIMEOUT_S", 5.0, env),
            inputs=InputsConfig.from_env(env),
            metrics_addr=env_str("KVRS_METRICS_ADDR", "", env),
            grpc=GrpcSettings.from_env(env),
        )
        require_positive(
            ("COST_ORACLE_REFRESH_S", config.refresh_s),
            ("COST_ORACLE_PEER_TIMEOUT_S", config.peer_timeout_s),
        )
        return config
