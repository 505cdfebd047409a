"""Configuration of the recovery scheduler, read from the environment."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrs.errors import KvrsError
from kvrs.placement import make_placement_policy
from kvrs.recovery import make_recovery_policy
from services.common import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_REDIS_URL,
    ConfigError,
    GrpcSettings,
    RedisTls,
    env_bool,
    env_float,
    env_int,
    env_str,
    redis_from_env,
    require_positive,
)
from services.common.decision_inputs import InputsConfig

SLOT_RESERVATIONS = ("redis", "broker")


def _default_holder_id() -> str:
    return f"scheduler-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class Config:
    """Everything `python -m services.scheduler` needs; `from_env` names any bad variable."""

    listen_addr: str = "0.0.0.0:50053"
    """SCHEDULER_LISTEN_ADDR: host:port the gRPC server binds ("127.0.0.1:0" in tests)."""
    gossip_addr: str = "127.0.0.1:50051"
    """GOSSIP_ADDR: host:port of the gossip store."""
    slot_broker_addr: str = "127.0.0.1:50054"
    """SLOT_BROKER_ADDR: host:port of the slot broker."""
    slot_reservations: str = "broker"
    """SCHEDULER_SLOT_RESERVATIONS: `redis` reserves migration slots in the broker's Redis
    with the broker's own script (one round trip, the same caps, published by the broker);
    `broker` asks the slot broker over gRPC. Default: `redis` when REDIS_URL is set."""
    redis_url: str = DEFAULT_REDIS_URL
    """REDIS_URL: the slot broker's Redis (used when reserving there directly), which
    also holds the shared outcome log."""
    redis_prefix: str = DEFAULT_KEY_PREFIX
    """KVRS_REDIS_PREFIX: the slot broker's key prefix (and the outcome log's)."""
    redis_tls: RedisTls = RedisTls()
    """KVRS_REDIS_TLS_*: TLS material for a rediss:// Redis."""
    placement_policy: str = "netkv"
    """SCHEDULER_PLACEMENT_POLICY: SelectDecode's policy when a request names none
    (round_robin, least_loaded, cache_load, netkv)."""
    recovery_policy: str = "kvrs"
    """SCHEDULER_RECOVERY_POLICY: Recover's policy when a request names none
    (always_migrate, always_recompute, rom, kvrs)."""
    view_refresh_s: float = 0.1
    """SCHEDULER_VIEW_REFRESH_S: how often the cached view of gossip is refreshed."""
    view_stale_after_s: float = 1.0
    """SCHEDULER_VIEW_STALE_AFTER_S: a view older than this is reported `view_stale`."""
    view_fetch_timeout_s: float = 5.0
    """SCHEDULER_VIEW_FETCH_TIMEOUT_S: deadline of each gossip fetch of a view refresh.
    No decision waits for one (decisions read the cached view), and at thousands of
    instances a loaded gossip needs seconds to list them: a shorter deadline leaves the
    view never refreshed, every attempt asking for more than the one before."""
    peer_timeout_s: float = 0.5
    """SCHEDULER_PEER_TIMEOUT_S: deadline of each slot broker call; a slot reservation
    slower than this counts as "broker unreachable" (the decision falls back)."""
    slot_ttl_s: float = 0.0
    """SCHEDULER_SLOT_TTL_S: lifetime of a reserved migration slot; 0 = the broker default."""
    spare_slots: int = 2
    """SCHEDULER_SPARE_SLOTS: migration slots this replica reserves ahead (with `redis`
    reservations), so a decision that needs one answers without a round trip; kept only
    while under half the cluster cap is held and without a per-link cap. 0 = none."""
    holder_id: str = field(default_factory=_default_holder_id)
    """SCHEDULER_HOLDER_ID: the name slots are leased under (default scheduler-<host>-<pid>)."""
    recover_replay_s: float = 30.0
    """SCHEDULER_RECOVER_REPLAY_S: a Recover retried with the same request id within this
    window returns the first decision and lease instead of deciding again."""
    recover_replay_entries: int = 4096
    """SCHEDULER_RECOVER_REPLAY_ENTRIES: at most this many decisions are remembered."""
    metrics_addr: str = ""
    """KVRS_METRICS_ADDR: host:port of the Prometheus endpoint; empty = off."""
    learning: bool = True
    """SCHEDULER_LEARNING: price decisions with the corrections fitted from reported
    outcomes (1, the default) or with the base model alone (0)."""
    learning_refresh_s: float = 1.0
    """SCHEDULER_LEARNING_REFRESH_S: how often the shared outcome log is re-read and refitted."""
    outcome_capacity: int = 2048
    """SCHEDULER_OUTCOME_CAPACITY: outcomes the shared log keeps (the newest)."""
    inputs: InputsConfig = field(default_factory=InputsConfig)
    """KVRS_TOPOLOGY_FILE, KVRS_MODEL, KVRS_PROFILE_FILE, KVRS_TELEMETRY_STALE_AFTER_S."""
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    """TLS, message size and shutdown grace (KVRS_TLS_*, KVRS_MAX_MESSAGE_BYTES, ...)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        redis_url, redis_prefix, redis_tls = redis_from_env(env)
        redis_given = "REDIS_URL" in (os.environ if env is None else env)
        config = cls(
            listen_addr=env_str("SCHEDULER_LISTEN_ADDR", "0.0.0.0:50053", env),
            gossip_addr=env_str("GOSSIP_ADDR", "127.0.0.1:50051", env),
            slot_broker_addr=env_str("SLOT_BROKER_ADDR", "127.0.0.1:50054", env),
            slot_reservations=env_str(
                "SCHEDULER_SLOT_RESERVATIONS", "redis" if redis_given else "broker", env
            ),
            redis_url=redis_url,
            redis_prefix=redis_prefix,
            redis_tls=redis_tls,
            placement_policy=env_str("SCHEDULER_PLACEMENT_POLICY", "netkv", env),
            recovery_policy=env_str("SCHEDULER_RECOVERY_POLICY", "kvrs", env),
            view_refresh_s=env_float("SCHEDULER_VIEW_REFRESH_S", 0.1, env),
            view_stale_after_s=env_float("SCHEDULER_VIEW_STALE_AFTER_S", 1.0, env),
            view_fetch_timeout_s=env_float("SCHEDULER_VIEW_FETCH_TIMEOUT_S", 5.0, env),
            peer_timeout_s=env_float("SCHEDULER_PEER_TIMEOUT_S", 0.5, env),
            slot_ttl_s=env_float("SCHEDULER_SLOT_TTL_S", 0.0, env),
            spare_slots=env_int("SCHEDULER_SPARE_SLOTS", 2, env),
            holder_id=env_str("SCHEDULER_HOLDER_ID", _default_holder_id(), env),
            recover_replay_s=env_float("SCHEDULER_RECOVER_REPLAY_S", 30.0, env),
            recover_replay_entries=env_int("SCHEDULER_RECOVER_REPLAY_ENTRIES", 4096, env),
            metrics_addr=env_str("KVRS_METRICS_ADDR", "", env),
            learning=env_bool("SCHEDULER_LEARNING", True, env),
            learning_refresh_s=env_float("SCHEDULER_LEARNING_REFRESH_S", 1.0, env),
            outcome_capacity=env_int("SCHEDULER_OUTCOME_CAPACITY", 2048, env),
            inputs=InputsConfig.from_env(env),
            grpc=GrpcSettings.from_env(env),
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Fails fast, naming the variable, on a value the scheduler cannot run with."""
        require_positive(
            ("SCHEDULER_VIEW_REFRESH_S", self.view_refresh_s),
            ("SCHEDULER_VIEW_STALE_AFTER_S", self.view_stale_after_s),
            ("SCHEDULER_VIEW_FETCH_TIMEOUT_S", self.view_fetch_timeout_s),
            ("SCHEDULER_PEER_TIMEOUT_S", self.peer_timeout_s),
            ("SCHEDULER_RECOVER_REPLAY_ENTRIES", self.recover_replay_entries),
            ("SCHEDULER_LEARNING_REFRESH_S", self.learning_refresh_s),
            ("SCHEDULER_OUTCOME_CAPACITY", self.outcome_capacity),
        )
        for name, value in (
            ("SCHEDULER_SLOT_TTL_S", self.slot_ttl_s),
            ("SCHEDULER_SPARE_SLOTS", self.spare_slots),
            ("SCHEDULER_RECOVER_REPLAY_S", self.recover_replay_s),
        ):
            if value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if self.slot_reservations not in SLOT_RESERVATIONS:
            raise ConfigError(
                f"SCHEDULER_SLOT_RESERVATIONS must be one of {', '.join(SLOT_RESERVATIONS)}, "
                f"got {self.slot_reservations!r}"
            )
        for name, make, policy in (
            ("SCHEDULER_PLACEMENT_POLICY", make_placement_policy, self.placement_policy),
            ("SCHEDULER_RECOVERY_POLICY", make_recovery_policy, self.recovery_policy),
        ):
            try:
                make(policy)
            except KvrsError as exc:
                raise ConfigError(f"{name}: {exc}") from None
