"""Configuration of the bandwidth prober, read from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common import ConfigError, GrpcSettings, env_float, env_int, env_str, require_positive

PAIR_MODES = ("prefill-decode", "all")


@dataclass(frozen=True)
class Config:
    """Everything `python -m services.prober` needs; `from_env` names any bad variable."""

    listen_addr: str = "0.0.0.0:50055"
    """PROBER_LISTEN_ADDR: host:port the gRPC server binds ("127.0.0.1:0" in tests)."""
    gossip_addr: str = "127.0.0.1:50051"
    """GOSSIP_ADDR: where workers are listed and link samples are reported."""
    pairs: str = "prefill-decode"
    """PROBER_PAIRS: which links to measure: "prefill-decode" (every prefill -> decode
    pair, the direction KV flows on placement and recovery) or "all" (every ordered pair)."""
    budget_fraction: float = 0.02
    """PROBER_BUDGET_FRACTION: the most of a link's time its probes may take (probe time
    over wall time); the pause after a probe of d seconds is d / fraction - d."""
    target_probe_s: float = 0.2
    """PROBER_TARGET_PROBE_S: how long one probe should keep the link busy; the payload is
    sized from the link's estimate so short probes do not drown in per-transfer setup."""
    interval_s: float = 5.0
    """PROBER_INTERVAL_S: the longest a link goes unprobed when the budget allows more."""
    payload_tokens: int = 2048
    """PROBER_PAYLOAD_TOKENS: tokens of the synthetic KV each source keeps resident for
    probes (at most the model's positions); a probe pulls some or all of it, repeatedly."""
    max_pulls: int = 16
    """PROBER_MAX_PULLS: most pulls of the payload one probe makes to reach its target."""
    payload_lease_s: float = 3600.0
    """PROBER_PAYLOAD_LEASE_S: lease of the payload on each source (re-created when lost)."""
    ewma_alpha: float = 0.2
    """PROBER_EWMA_ALPHA: weight of a new sample in the per-link estimate."""
    pacing_bps: float = 0.0
    """PROBER_PACING_BPS: cap on the probes' send rate (emulated links); 0 = the sources'
    own setting (WORKER_TRANSFER_PACING_BPS)."""
    max_probes_per_s: float = 20.0
    """PROBER_MAX_PROBES_PER_S: most probes started a second, however fast they fail."""
    worker_timeout_s: float = 30.0
    """PROBER_WORKER_TIMEOUT_S: deadline of each worker call."""
    refresh_s: float = 1.0
    """PROBER_REFRESH_S: how often the worker list is re-read from gossip."""
    metrics_addr: str = ""
    """KVRS_METRICS_ADDR: host:port of the Prometheus endpoint; empty = off."""
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    """TLS, message size and shutdown grace (KVRS_TLS_*, KVRS_MAX_MESSAGE_BYTES, ...)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        config = cls(
            listen_addr=env_str("PROBER_LISTEN_ADDR", "0.0.0.0:50055", env),
            gossip_addr=env_str("GOSSIP_ADDR", "127.0.0.1:50051", env),
            pairs=env_str("PROBER_PAIRS", "prefill-decode", env),
            budget_fraction=env_float("PROBER_BUDGET_FRACTION", 0.02, env),
            target_probe_s=env_float("PROBER_TARGET_PROBE_S", 0.2, env),
            interval_s=env_float("PROBER_INTERVAL_S", 5.0, env),
            payload_tokens=env_int("PROBER_PAYLOAD_TOKENS", 2048, env),
            max_pulls=env_int("PROBER_MAX_PULLS", 16, env),
            payload_lease_s=env_float("PROBER_PAYLOAD_LEASE_S", 3600.0, env),
            ewma_alpha=env_float("PROBER_EWMA_ALPHA", 0.2, env),
            pacing_bps=env_float("PROBER_PACING_BPS", 0.0, env),
            max_probes_per_s=env_float("PROBER_MAX_PROBES_PER_S", 20.0, env),
            worker_timeout_s=env_float("PROBER_WORKER_TIMEOUT_S", 30.0, env),
            refresh_s=env_float("PROBER_REFRESH_S", 1.0, env),
            metrics_addr=env_str("KVRS_METRICS_ADDR", "", env),
            grpc=GrpcSettings.from_env(env),
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Fails fast, naming the variable, on a value the prober cannot run with."""
        if self.pairs not in PAIR_MODES:
            raise ConfigError(f"PROBER_PAIRS must be one of {PAIR_MODES}, got {self.pairs!r}")
        if not 0 < self.budget_fraction <= 1:
            raise ConfigError(
                f"PROBER_BUDGET_FRACTION must be in (0, 1], got {self.budget_fraction}"
            )
        if not 0 < self.ewma_alpha <= 1:
            raise ConfigError(f"PROBER_EWMA_ALPHA must be in (0, 1], got {self.ewma_alpha}")
        require_positive(
            ("PROBER_TARGET_PROBE_S", self.target_probe_s),
            ("PROBER_INTERVAL_S", self.interval_s),
            ("PROBER_PAYLOAD_TOKENS", self.payload_tokens),
            ("PROBER_MAX_PULLS", self.max_pulls),
            ("PROBER_PAYLOAD_LEASE_S", self.payload_lease_s),
            ("PROBER_MAX_PROBES_PER_S", self.max_probes_per_s),
            ("PROBER_WORKER_TIMEOUT_S", self.worker_timeout_s),
            ("PROBER_REFRESH_S", self.refresh_s),
        )
        if self.pacing_bps < 0:
            raise ConfigError(f"PROBER_PACING_BPS must be >= 0, got {self.pacing_bps}")
