"""Bootstrap, errors, telemetry and Redis shared by every kvrs service, over `kvrs.rpc`
(channels, TLS and settings, re-exported here so a service imports one package)."""

from kvrs.rpc import (
    DEFAULT_RPC_TIMEOUT_S,
    ConfigError,
    GrpcSettings,
    TlsConfig,
    env_bool,
    env_float,
    env_int,
    env_str,
    open_channel,
    require_positive,
)
from services.common.errors import ErrorInterceptor, status_for
from services.common.metrics import Metrics, serve_metrics
from services.common.redis_store import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_REDIS_URL,
    Keys,
    RedisClient,
    RedisTls,
    connect_redis,
    is_cluster_url,
    redis_from_env,
)
from services.common.server import (
    ServerHandle,
    configure_logging,
    run_until_signal,
    start_server,
)
from services.common.telemetry import (
    client_interceptors,
    context_from_traceparent,
    server_interceptors,
    setup_tracing,
    traceparent,
)

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_REDIS_URL",
    "DEFAULT_RPC_TIMEOUT_S",
    "ConfigError",
    "ErrorInterceptor",
    "GrpcSettings",
    "Keys",
    "Metrics",
    "RedisClient",
    "RedisTls",
    "ServerHandle",
    "TlsConfig",
    "client_interceptors",
    "configure_logging",
    "connect_redis",
    "context_from_traceparent",
    "env_bool",
    "env_float",
    "env_int",
    "env_str",
    "is_cluster_url",
    "open_channel",
    "redis_from_env",
    "require_positive",
    "run_until_signal",
    "serve_metrics",
    "server_interceptors",
    "setup_tracing",
    "start_server",
    "status_for",
    "traceparent",
]
