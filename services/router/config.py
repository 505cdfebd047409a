"""Configuration of the router, read from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrs.client import parse_addresses
from kvrs.errors import KvrsError
from kvrs.model import DEFAULT_MODEL
from kvrs.placement import make_placement_policy
from kvrs.recovery import make_recovery_policy
from services.common import (
    ConfigError,
    GrpcSettings,
    env_bool,
    env_float,
    env_int,
    env_str,
    require_positive,
)


@dataclass(frozen=True)
class Config:
    """Everything `python -m services.router` needs; `from_env` names any bad variable."""

    listen_addr: str = "0.0.0.0:50056"
    """ROUTER_LISTEN_ADDR: host:port the gRPC server binds ("127.0.0.1:0" in tests)."""
    gossip_addr: str = "127.0.0.1:50051"
    """GOSSIP_ADDR: the gossip store (instances, load, failure events)."""
    scheduler_addrs: tuple[str, ...] = ("127.0.0.1:50053",)
    """SCHEDULER_ADDRS: scheduler replicas, comma-separated; a call that finds one
    unavailable goes to the next."""
    slot_broker_addr: str = "127.0.0.1:50054"
    """SLOT_BROKER_ADDR: where migration slot leases are renewed and released."""
    placement_policy: str = ""
    """ROUTER_PLACEMENT_POLICY: SelectDecode policy for requests naming none; empty = the
    scheduler's default. Under kvrs, which chooses the prefill instance too, the router
    asks before the prefill (one SelectDecode round trip ahead of it)."""
    recovery_policy: str = ""
    """ROUTER_RECOVERY_POLICY: Recover policy for requests naming none; empty = the
    scheduler's default."""
    model: str = DEFAULT_MODEL
    """KVRS_MODEL: model preset; its compute profile prices prefill when choosing where to
    prefill (queued work + prefill of the tokens not already cached)."""
    profile_file: str = ""
    """KVRS_PROFILE_FILE: a calibrated ComputeProfile JSON; empty = the model's preset."""
    worker_timeout_s: float = 30.0
    """ROUTER_WORKER_TIMEOUT_S: deadline of each unary worker call (prefill, pull, extend)."""
    decode_idle_timeout_s: float = 10.0
    """ROUTER_DECODE_IDLE_TIMEOUT_S: a Decode stream silent this long counts as a failed
    decode instance (a hung process that still holds its connection)."""
    control_timeout_s: float = 2.0
    """ROUTER_CONTROL_TIMEOUT_S: deadline of each scheduler / slot broker / gossip call."""
    instance_wait_s: float = 5.0
    """ROUTER_INSTANCE_WAIT_S: how long a request that finds no instance to use (no alive
    prefill instance to prefill on, no decode instance to place or recover it on) waits
    for one to come back (a suspect one refuted, a restarted one registered), asking
    again every few hundred ms, before it gives up; never past the request's deadline.
    0 = give up at once."""
    max_requests_per_decode: int = 0
    """ROUTER_MAX_REQUESTS_PER_DECODE: requests in flight (admitted, not yet ended) this
    router takes for each alive decode instance; beyond that a new request is refused at
    once with RESOURCE_EXHAUSTED (load shedding: it fails fast instead of queueing past
    its deadline). 0 = no limit."""
    deadline_admission: bool = False
    """ROUTER_DEADLINE_ADMISSION: refuse at once, with RESOURCE_EXHAUSTED, a request with
    a deadline that an equal share of the tokens the cluster is delivering now would
    finish past it (`kvrs.admission`); requests without a deadline are always admitted.
    0 = off."""
    stream_kv: bool = True
    """ROUTER_STREAM_KV: layer-wise streaming. The decode instance is chosen while the
    prompt prefills and pulls each layer's KV as soon as the prefill has computed it, so
    the transfer hides under the prefill; 0 = pull the KV once the prefill has ended."""
    stream_kv_min_tokens: int = 512
    """ROUTER_STREAM_KV_MIN_TOKENS: shorter prompts move their KV after the prefill. Their
    transfer is short and so is the prefill it would hide under, while the pull's calls
    and threads would run during that prefill, where they delay the first token."""
    batch_window_s: float = 0.05
    """ROUTER_BATCH_WINDOW_S: after a decode instance is lost, how long to wait for its
    other requests to stop before planning them together with RecoverBatch."""
    view_refresh_s: float = 0.2
    """ROUTER_VIEW_REFRESH_S: how often instances and their load are re-read from gossip."""
    metrics_addr: str = ""
    """KVRS_METRICS_ADDR: host:port of the Prometheus endpoint; empty = off."""
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    """TLS, message size and shutdown grace (KVRS_TLS_*, KVRS_MAX_MESSAGE_BYTES, ...)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        config = cls(
            listen_addr=env_str("ROUTER_LISTEN_ADDR", "0.0.0.0:50056", env),
            gossip_addr=env_str("GOSSIP_ADDR", "127.0.0.1:50051", env),
            scheduler_addrs=parse_addresses(
                env_str("SCHEDULER_ADDRS", "127.0.0.1:50053", env), "SCHEDULER_ADDRS"
            ),
            slot_broker_addr=env_str("SLOT_BROKER_ADDR", "127.0.0.1:50054", env),
            placement_policy=env_str("ROUTER_PLACEMENT_POLICY", "", env),
            recovery_policy=env_str("ROUTER_RECOVERY_POLICY", "", env),
            model=env_str("KVRS_MODEL", DEFAULT_MODEL, env),
            profile_file=env_str("KVRS_PROFILE_FILE", "", env),
            worker_timeout_s=env_float("ROUTER_WORKER_TIMEOUT_S", 30.0, env),
            decode_idle_timeout_s=env_float("ROUTER_DECODE_IDLE_TIMEOUT_S", 10.0, env),
            control_timeout_s=env_float("ROUTER_CONTROL_TIMEOUT_S", 2.0, env),
            instance_wait_s=env_float("ROUTER_INSTANCE_WAIT_S", 5.0, env),
            max_requests_per_decode=env_int("ROUTER_MAX_REQUESTS_PER_DECODE", 0, env),
            deadline_admission=env_bool("ROUTER_DEADLINE_ADMISSION", False, env),
            stream_kv=env_bool("ROUTER_STREAM_KV", True, env),
            stream_kv_min_tokens=env_int("ROUTER_STREAM_KV_MIN_TOKENS", 512, env),
            batch_window_s=env_float("ROUTER_BATCH_WINDOW_S", 0.05, env),
            view_refresh_s=env_float("ROUTER_VIEW_REFRESH_S", 0.2, env),
            metrics_addr=env_str("KVRS_METRICS_ADDR", "", env),
            grpc=GrpcSettings.from_env(env),
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Fails fast, naming the variable, on a value the router cannot run with."""
        require_positive(
            ("ROUTER_WORKER_TIMEOUT_S", self.worker_timeout_s),
            ("ROUTER_DECODE_IDLE_TIMEOUT_S", self.decode_idle_timeout_s),
            ("ROUTER_CONTROL_TIMEOUT_S", self.control_timeout_s),
            ("ROUTER_VIEW_REFRESH_S", self.view_refresh_s),
        )
        if self.batch_window_s < 0:
            raise ConfigError(f"ROUTER_BATCH_WINDOW_S must be >= 0, got {self.batch_window_s}")
        if self.max_requests_per_decode < 0:
            raise ConfigError(
                f"ROUTER_MAX_REQUESTS_PER_DECODE must be >= 0, got {self.max_requests_per_decode}"
            )
        if self.stream_kv_min_tokens < 0:
            raise ConfigError(
                f"ROUTER_STREAM_KV_MIN_TOKENS must be >= 0, got {self.stream_kv_min_tokens}"
            )
        if self.instance_wait_s < 0:
            raise ConfigError(f"ROUTER_INSTANCE_WAIT_S must be >= 0, got {self.instance_wait_s}")
        for name, make, value in (
            ("ROUTER_PLACEMENT_POLICY", make_placement_policy, self.placement_policy),
            ("ROUTER_RECOVERY_POLICY", make_recovery_policy, self.recovery_policy),
        ):
            if not value:
                continue
            try:
                make(value)
            except KvrsError as exc:
                raise ConfigError(f"{name}: {exc}") from None
