"""The decision inputs the scheduler and the cost oracle both load: topology, model, profile.

Both services must price a transfer or a prefill identically, so they read the same
environment variables through this one module and build the same core objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvrs.errors import InvalidArgument, KvrsError
from kvrs.estimator import StalenessPolicy
from kvrs.model import DEFAULT_MODEL, ModelSpec, model_spec
from kvrs.profile import ComputeProfile, compute_profile
from kvrs.rpc import ConfigError, env_float, env_int, env_str
from kvrs.topology import Topology
from services.common.gossip_follow import DEFAULT_RESYNC_S

DEFAULT_TELEMETRY_STALE_AFTER_S = 60.0
DEFAULT_MAX_CONTEXT_TOKENS = 10_000_000
INT64_MAX = 2**63 - 1
"""Largest value of the int64 `kv_bytes` fields every reply carries."""


@dataclass(frozen=True)
class InputsConfig:
    """Where the decision inputs come from (shared by the scheduler and the cost oracle)."""

    topology_file: str = ""
    """KVRS_TOPOLOGY_FILE: topology YAML (docs/topology.md); empty = instances come only
    from gossip, placed by their registered node/rack/pod with the default tier specs."""
    model: str = DEFAULT_MODEL
    """KVRS_MODEL: model preset whose KV bytes per token prices every transfer."""
    profile_file: str = ""
    """KVRS_PROFILE_FILE: a ComputeProfile JSON; empty = the model's preset profile."""
    telemetry_stale_after_s: float = DEFAULT_TELEMETRY_STALE_AFTER_S
    """KVRS_TELEMETRY_STALE_AFTER_S: a link measurement older than this is ignored and the
    topology capacity is used instead (flagged telemetry_stale)."""
    max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS
    """KVRS_MAX_CONTEXT_TOKENS: the most tokens one request's KV may hold; a request
    counting more is refused INVALID_ARGUMENT before its KV size is priced."""
    view_resync_s: float = DEFAULT_RESYNC_S
    """KVRS_VIEW_RESYNC_S: seconds between full listings of the registry; the view follows
    gossip's change feed in between. 0 = a full listing at every refresh."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> InputsConfig:
        config = cls(
            topology_file=env_str("KVRS_TOPOLOGY_FILE", "", env),
            model=env_str("KVRS_MODEL", DEFAULT_MODEL, env),
            profile_file=env_str("KVRS_PROFILE_FILE", "", env),
            telemetry_stale_after_s=env_float(
                "KVRS_TELEMETRY_STALE_AFTER_S", DEFAULT_TELEMETRY_STALE_AFTER_S, env
            ),
            max_context_tokens=env_int("KVRS_MAX_CONTEXT_TOKENS", DEFAULT_MAX_CONTEXT_TOKENS, env),
            view_resync_s=env_float("KVRS_VIEW_RESYNC_S", DEFAULT_RESYNC_S, env),
        )
        if config.telemetry_stale_after_s <= 0:
            raise ConfigError("KVRS_TELEMETRY_STALE_AFTER_S must be > 0")
        if config.max_context_tokens <= 0:
            raise ConfigError("KVRS_MAX_CONTEXT_TOKENS must be > 0")
        if config.view_resync_s < 0:
            raise ConfigError("KVRS_VIEW_RESYNC_S must be >= 0")
        return config


@dataclass(frozen=True)
class DecisionInputs:
    """The static half of every decision; gossip supplies the live half."""

    topology: Topology
    model: ModelSpec
    compute: ComputeProfile
    staleness: StalenessPolicy
    max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS
    """The most tokens one request's KV may hold (its KV bytes then fit an int64)."""

    def require_context_tokens(self, field: str, tokens: int) -> None:
        """InvalidArgument naming `field` when `tokens` exceeds the longest context: its KV
        size would be meaningless, and past int64 it could not even be sent back."""
        if tokens > self.max_context_tokens:
            raise InvalidArgument(
                field,
                f"must be at most {self.max_context_tokens} tokens "
                f"(KVRS_MAX_CONTEXT_TOKENS), got {tokens}",
            )


def load_inputs(config: InputsConfig) -> DecisionInputs:
    """Loads and checks every input; a bad file or name fails at start, naming the variable."""
    try:
        model = model_spec(config.model)
    except KvrsError as exc:
        raise ConfigError(f"KVRS_MODEL: {exc}") from None
    if config.max_context_tokens * model.kv_bytes_per_token > INT64_MAX:
        raise ConfigError(
            f"KVRS_MAX_CONTEXT_TOKENS={config.max_context_tokens}: the KV of that many "
            f"tokens of {model.name} does not fit the int64 kv_bytes fields"
        )
    return DecisionInputs(
        topology=_load_topology(config.topology_file),
        model=model,
        compute=load_profile(config.profile_file, config.model),
        staleness=StalenessPolicy(stale_after_s=config.telemetry_stale_after_s),
        max_context_tokens=config.max_context_tokens,
    )


def _load_topology(path: str) -> Topology:
    if not path:
        return Topology.from_dict({})
    if not Path(path).is_file():
        raise ConfigError(f"KVRS_TOPOLOGY_FILE names a missing file: {path}")
    try:
        return Topology.from_yaml(path)
    except (KvrsError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"KVRS_TOPOLOGY_FILE {path}: {exc}") from None


def load_profile(path: str, model: str) -> ComputeProfile:
    """The profile in `path` (KVRS_PROFILE_FILE), else `model`'s preset; ConfigError naming
    the variable when it cannot be loaded or was calibrated for another model."""
    if not path:
        try:
            return compute_profile(model)
        except KvrsError as exc:
            raise ConfigError(f"KVRS_MODEL has no preset compute profile: {exc}") from None
    if not Path(path).is_file():
        raise ConfigError(f"KVRS_PROFILE_FILE names a missing file: {path}")
    try:
        profile = ComputeProfile.load(path)
    except (KvrsError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"KVRS_PROFILE_FILE {path}: {exc}") from None
    if profile.model != model:
        raise ConfigError(
            f"KVRS_PROFILE_FILE is calibrated for {profile.model!r}, KVRS_MODEL is {model!r}"
        )
    return profile
