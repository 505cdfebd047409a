"""Environment-variable helpers and the TLS / message-size settings every gRPC process shares.

Required values fail fast and name the variable, so a misconfigured container dies at
start with a readable message instead of at its first request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
RECONNECT_BACKOFF_MIN_MS = 100
RECONNECT_BACKOFF_MAX_MS = 1000
MIN_CONNECT_TIMEOUT_MS = 2000
"""How long one connection attempt may take to finish its HTTP/2 handshake (gRPC reads
`grpc.min_reconnect_backoff_ms` as this floor, not as a backoff)."""


class ConfigError(ValueError):
    """A configuration variable is missing or malformed; the message names it."""


def env_str(name: str, default: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The variable's value; `default` when unset; ConfigError when unset without default."""
    source = os.environ if env is None else env
    value = source.get(name, "")
    if value != "":
        return value
    if default is None:
        raise ConfigError(f"{name} is required")
    return default


def env_float(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    raw = env_str(name, str(default), env)
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None


def env_int(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    raw = env_str(name, str(default), env)
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def env_bool(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    raw = env_str(name, "1" if default else "0", env).strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be a boolean (1/0, true/false), got {raw!r}")


def require_positive(*settings: tuple[str, float]) -> None:
    """ConfigError naming the first variable whose value is not > 0 (NaN included)."""
    for name, value in settings:
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class TlsConfig:
    """TLS material for gRPC servers and clients, read from `KVRS_TLS_*`.

    With no certificate configured, servers and clients speak plaintext (local clusters).
    """

    cert_file: str = ""
    """PEM certificate this process presents (server cert, or client cert for mTLS)."""
    key_file: str = ""
    """PEM private key for `cert_file`."""
    ca_file: str = ""
    """PEM bundle used to verify the peer; required for clients when TLS is on."""
    require_client_cert: bool = False
    """Servers reject clients without a certificate signed by `ca_file` (mTLS)."""
    server_name_override: str = ""
    """Clients: expected name in the server certificate when dialling by IP."""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.ca_file)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TlsConfig:
        config = cls(
            cert_file=env_str("KVRS_TLS_CERT_FILE", "", env),
            key_file=env_str("KVRS_TLS_KEY_FILE", "", env),
            ca_file=env_str("KVRS_TLS_CA_FILE", "", env),
            require_client_cert=env_bool("KVRS_TLS_REQUIRE_CLIENT_CERT", False, env),
            server_name_override=env_str("KVRS_TLS_SERVER_NAME", "", env),
        )
        for name, path in (
            ("KVRS_TLS_CERT_FILE", config.cert_file),
            ("KVRS_TLS_KEY_FILE", config.key_file),
            ("KVRS_TLS_CA_FILE", config.ca_file),
        ):
            if path and not Path(path).is_file():
                raise ConfigError(f"{name} names a missing file: {path}")
        if bool(config.cert_file) != bool(config.key_file):
            raise ConfigError("KVRS_TLS_CERT_FILE and KVRS_TLS_KEY_FILE must be set together")
        if config.require_client_cert and not config.ca_file:
            raise ConfigError("KVRS_TLS_REQUIRE_CLIENT_CERT needs KVRS_TLS_CA_FILE")
        return config

    def read(self, path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class GrpcSettings:
    """Settings every gRPC server and client of one process shares."""

    tls: TlsConfig = TlsConfig()
    """Transport security; plaintext when not enabled."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message accepted or sent; bigger ones fail with RESOURCE_EXHAUSTED."""
    shutdown_grace_s: float = 5.0
    """How long in-flight RPCs may finish after SIGTERM before they are cancelled."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GrpcSettings:
        return cls(
            tls=TlsConfig.from_env(env),
            max_message_bytes=env_int("KVRS_MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES, env),
            shutdown_grace_s=env_float("KVRS_SHUTDOWN_GRACE_S", 5.0, env),
        )

    def channel_options(self) -> list[tuple[str, int | str]]:
        options: list[tuple[str, int | str]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # gRPC backs off up to 120 s between reconnects by default, and fails calls
            # at once meanwhile: a worker restarted at its old address would stay
            # unreachable to its peers for minutes. Inside a cluster, retry every second.
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MIN_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
            # The minimum "backoff" is the time one attempt gets to connect: at 100 ms, a
            # first call to a peer whose event loop a forward pass keeps busy failed with
            # "timed out before receiving SETTINGS frame".
            ("grpc.min_reconnect_backoff_ms", MIN_CONNECT_TIMEOUT_MS),
        ]
        if self.tls.server_name_override:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name_override))
        return options
