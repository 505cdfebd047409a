"""The gRPC edge every kvrs caller shares: channels, TLS and message settings, health
checks, and the one mapping between `kvrs.errors` and status codes.

The typed client (`kvrs.client`), the CLI and every service build on this package; it
imports grpc, protobuf and OpenTelemetry, never `services` (nor redis, torch, aiohttp).
"""

from kvrs.rpc.channels import (
    DEFAULT_RPC_TIMEOUT_S,
    channel_credentials,
    client_interceptors,
    open_channel,
)
from kvrs.rpc.errors import (
    error_for_code,
    error_from_rpc,
    relayed,
    status_code,
    status_for_error,
)
from kvrs.rpc.health import SERVING, check_health
from kvrs.rpc.settings import (
    ConfigError,
    GrpcSettings,
    TlsConfig,
    env_bool,
    env_float,
    env_int,
    env_str,
    require_positive,
)

__all__ = [
    "DEFAULT_RPC_TIMEOUT_S",
    "SERVING",
    "ConfigError",
    "GrpcSettings",
    "TlsConfig",
    "channel_credentials",
    "check_health",
    "client_interceptors",
    "env_bool",
    "env_float",
    "env_int",
    "env_str",
    "error_for_code",
    "error_from_rpc",
    "open_channel",
    "relayed",
    "require_positive",
    "status_code",
    "status_for_error",
]
