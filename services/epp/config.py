"""Configuration of the endpoint picker, read from the environment."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrs.client import parse_addresses
from kvrs.errors import KvrsError
from kvrs.model import DEFAULT_MODEL, model_spec
from kvrs.profile import ComputeProfile
from services.common import ConfigError, GrpcSettings, env_float, env_int, env_str, require_positive
from services.common.decision_inputs import load_profile
from services.epp.endpoints import split_address


@dataclass(frozen=True)
class Config:
    """Everything `python -m services.epp` needs; `from_env` names any bad variable."""

    listen_addr: str = "0.0.0.0:9002"
    """EPP_LISTEN_ADDR: host:port the ext_proc gRPC server binds ("127.0.0.1:0" in tests)."""
    scheduler_addrs: tuple[str, ...] = ("127.0.0.1:50053",)
    """SCHEDULER_ADDRS: the scheduler replicas asked for SelectDecode (comma-separated)."""
    gossip_addr: str = "127.0.0.1:50051"
    """GOSSIP_ADDR: the gossip store, which maps endpoint addresses to decode instances."""
    prefill_instance_id: str = ""
    """EPP_PREFILL_INSTANCE: the prefill instance placements are scored from (the KV's
    source); empty = the one the router would choose (`kvrs.prefill`: least queued work
    plus prefill of the tokens it does not hold)."""
    policy: str = ""
    """EPP_POLICY: placement policy asked of the scheduler; empty = the scheduler's default."""
    target_port: int = 0
    """EPP_TARGET_PORT: the port Envoy sends requests to on a decode instance's host (the
    InferencePool's target port); 0 = the port the instance registered in gossip."""
    endpoints: Mapping[str, str] = field(default_factory=dict)
    """EPP_ENDPOINTS: `instance=host:port,...`, where the gateway reaches each decode
    instance (e.g. an OpenAI adapter pinned to it); overrides the gossip address and
    EPP_TARGET_PORT, and instances it does not name are not routed to; empty = gossip."""
    fallback_endpoints: int = 0
    """EPP_FALLBACK_ENDPOINTS: how many fallback endpoints follow the pick in
    `x-gateway-destination-endpoint` (`ip:port,ip:port,...`, in order: the scheduler's
    runner-up first), for a gateway that retries down the list (protocol v0.4.0+); 0 =
    the pick alone, which an Envoy original-destination cluster needs (one address)."""
    prefiller_header: str = ""
    """EPP_PREFILLER_HEADER: the request header that names where the prompt prefills,
    `ip:port` of a prefill instance, for a P/D sidecar in front of each decode instance
    (llm-d's reads `x-prefiller-host-port`); with it the scheduler chooses the prefill
    instance with the decode one (kvrs policy). Empty = not sent."""
    prefill_target_port: int = 0
    """EPP_PREFILL_TARGET_PORT: the port the sidecar reaches a prefill instance at on its
    host (its model server's); 0 = the port the instance registered in gossip."""
    model: str = DEFAULT_MODEL
    """KVRS_MODEL: model preset; its block size cuts prompts into prefix-hash blocks, and
    its compute profile prices prefill when choosing the prefill instance."""
    profile_file: str = ""
    """KVRS_PROFILE_FILE: a calibrated ComputeProfile JSON; empty = the model's preset."""
    endpoints_refresh_s: float = 0.5
    """EPP_ENDPOINTS_REFRESH_S: how long the endpoint -> instance map from gossip is reused."""
    scheduler_timeout_s: float = 0.5
    """EPP_SCHEDULER_TIMEOUT_S: deadline of each SelectDecode / ListNodes attempt; keep it
    well under Envoy's ext_proc message_timeout."""
    metrics_addr: str = ""
    """KVRS_METRICS_ADDR: host:port of the Prometheus endpoint; empty = off."""
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    """TLS, message size and shutdown grace (KVRS_TLS_*, KVRS_MAX_MESSAGE_BYTES, ...)."""

    @property
    def block_tokens(self) -> int:
        return model_spec(self.model).block_tokens

    def profile(self) -> ComputeProfile:
        """The compute profile that prices prefill; ConfigError naming the variable."""
        return load_profile(self.profile_file, self.model)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        schedulers = env_str("SCHEDULER_ADDRS", "", env) or env_str(
            "SCHEDULER_ADDR", "127.0.0.1:50053", env
        )
        config = cls(
            listen_addr=env_str("EPP_LISTEN_ADDR", "0.0.0.0:9002", env),
            scheduler_addrs=parse_addresses(schedulers, "SCHEDULER_ADDRS"),
            gossip_addr=env_str("GOSSIP_ADDR", "127.0.0.1:50051", env),
            prefill_instance_id=env_str("EPP_PREFILL_INSTANCE", "", env),
            policy=env_str("EPP_POLICY", "", env),
            target_port=env_int("EPP_TARGET_PORT", 0, env),
            endpoints=parse_endpoints(env_str("EPP_ENDPOINTS", "", env)),
            fallback_endpoints=env_int("EPP_FALLBACK_ENDPOINTS", 0, env),
            prefiller_header=env_str("EPP_PREFILLER_HEADER", "", env).strip().lower(),
            prefill_target_port=env_int("EPP_PREFILL_TARGET_PORT", 0, env),
            model=env_str("KVRS_MODEL", DEFAULT_MODEL, env),
            profile_file=env_str("KVRS_PROFILE_FILE", "", env),
            endpoints_refresh_s=env_float("EPP_ENDPOINTS_REFRESH_S", 0.5, env),
            scheduler_timeout_s=env_float("EPP_SCHEDULER_TIMEOUT_S", 0.5, env),
            metrics_addr=env_str("KVRS_METRICS_ADDR", "", env),
            grpc=GrpcSettings.from_env(env),
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Fails fast, naming the variable, on a value the picker cannot run with."""
        require_positive(
            ("EPP_ENDPOINTS_REFRESH_S", self.endpoints_refresh_s),
            ("EPP_SCHEDULER_TIMEOUT_S", self.scheduler_timeout_s),
        )
        if self.fallback_endpoints < 0:
            raise ConfigError(f"EPP_FALLBACK_ENDPOINTS must be >= 0, got {self.fallback_endpoints}")
        for name, port in (
            ("EPP_TARGET_PORT", self.target_port),
            ("EPP_PREFILL_TARGET_PORT", self.prefill_target_port),
        ):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{name} must be a port (0-65535), got {port}")
        if self.prefiller_header and not _HEADER_NAME.fullmatch(self.prefiller_header):
            raise ConfigError(
                f"EPP_PREFILLER_HEADER must be an HTTP header name, got {self.prefiller_header!r}"
            )
        try:
            model_spec(self.model)
        except KvrsError as exc:
            raise ConfigError(f"KVRS_MODEL: {exc}") from None


_HEADER_NAME = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")
"""An HTTP header name (a token, lower case as HTTP/2 sends it)."""


def parse_endpoints(text: str) -> dict[str, str]:
    """EPP_ENDPOINTS (`instance=host:port,...`) as instance id -> host:port."""
    endpoints: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        instance_id, sep, address = item.partition("=")
        instance_id, address = instance_id.strip(), address.strip()
        try:
            if not sep or not instance_id:
                raise ValueError
            split_address(address)
        except ValueError:
            raise ConfigError(
                f"EPP_ENDPOINTS must be instance=host:port,..., got {item!r}"
            ) from None
        endpoints[instance_id] = address
    return endpoints
