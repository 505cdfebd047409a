"""Redis connections and key naming shared by the Redis-backed services.

Every key lives under one hash-tagged prefix (default "{kvrs}:"), so a Lua script
touching several keys works on Redis Cluster, and tests isolate by prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as redis_async

from kvrs.rpc import ConfigError, env_str

DEFAULT_KEY_PREFIX = "{kvrs}:"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class RedisTls:
    """Client TLS material for a `rediss://` Redis, read from `KVRS_REDIS_TLS_*`.

    A `rediss://` URL alone verifies the server against the system's CAs; a Redis with a
    private CA, or one that requires client certificates (`tls-auth-clients yes`), needs
    these. AUTH rides in the URL (`redis://user:password@host`).
    """

    ca_file: str = ""
    """PEM bundle that verifies the Redis server's certificate."""
    cert_file: str = ""
    """PEM certificate this process presents to a Redis that requires one."""
    key_file: str = ""
    """PEM private key for `cert_file`."""

    @classmethod
    def from_env(cls, redis_url: str, env: Mapping[str, str] | None = None) -> RedisTls:
        tls = cls(
            ca_file=env_str("KVRS_REDIS_TLS_CA_FILE", "", env),
            cert_file=env_str("KVRS_REDIS_TLS_CERT_FILE", "", env),
            key_file=env_str("KVRS_REDIS_TLS_KEY_FILE", "", env),
        )
        for name, path in (
            ("KVRS_REDIS_TLS_CA_FILE", tls.ca_file),
            ("KVRS_REDIS_TLS_CERT_FILE", tls.cert_file),
            ("KVRS_REDIS_TLS_KEY_FILE", tls.key_file),
        ):
            if path and not Path(path).is_file():
                raise ConfigError(f"{name} names a missing file: {path}")
        if bool(tls.cert_file) != bool(tls.key_file):
            raise ConfigError(
                "KVRS_REDIS_TLS_CERT_FILE and KVRS_REDIS_TLS_KEY_FILE must be set together"
            )
        if (tls.ca_file or tls.cert_file) and not redis_url.startswith("rediss://"):
            raise ConfigError(
                f"KVRS_REDIS_TLS_* need a rediss:// REDIS_URL, got {redis_url.partition(':')[0]}://"
            )
        return tls


def redis_from_env(env: Mapping[str, str] | None = None) -> tuple[str, str, RedisTls]:
    """(REDIS_URL, KVRS_REDIS_PREFIX, KVRS_REDIS_TLS_*) of a Redis-backed service, checked."""
    url = env_str("REDIS_URL", DEFAULT_REDIS_URL, env)
    prefix = env_str("KVRS_REDIS_PREFIX", DEFAULT_KEY_PREFIX, env)
    if "{" not in prefix or "}" not in prefix:
        raise ConfigError(
            f"KVRS_REDIS_PREFIX must contain a hash tag like '{{kvrs}}:', got {prefix!r}"
        )
    return url, prefix, RedisTls.from_env(url, env)


def connect_redis(url: str, tls: RedisTls | None = None) -> redis_async.Redis:
    """A pooled async client for `redis://`, `rediss://` (with `tls`) and AUTH in the URL."""
    options: dict[str, Any] = {}
    if tls is not None and tls.ca_file:
        options["ssl_ca_certs"] = tls.ca_file
    if tls is not None and tls.cert_file:
        options.update(ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file)
    return redis_async.Redis.from_url(
        url,
        socket_connect_timeout=1.0,
        socket_timeout=2.0,
        health_check_interval=5,
        retry_on_timeout=True,
        **options,
    )


class Keys:
    """Builds a service's keys under one prefix."""

    def __init__(self, prefix: str = DEFAULT_KEY_PREFIX) -> None:
        if "{" not in prefix or "}" not in prefix:
            raise ValueError(f"key prefix must contain a hash tag like '{{kvrs}}:': {prefix!r}")
        self.prefix = prefix

    def __call__(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)
