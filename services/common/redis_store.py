"""Redis connections and key naming shared by the Redis-backed services.

Every key lives under one hash-tagged prefix (default "{kvrs}:"), so a Lua script
touching several keys works on Redis Cluster, and tests isolate by prefix.
"""

from __future__ import annotations

import redis.asyncio as redis_async

DEFAULT_KEY_PREFIX = "{kvrs}:"


def connect_redis(url: str) -> redis_async.Redis:
    """A pooled async client; `rediss://` and `redis://:password@` (AUTH) work as in redis-py."""
    return redis_async.Redis.from_url(
        url,
        socket_connect_timeout=1.0,
        socket_timeout=2.0,
        health_check_interval=5,
        retry_on_timeout=True,
    )


class Keys:
    """Builds a service's keys under one prefix."""

    def __init__(self, prefix: str = DEFAULT_KEY_PREFIX) -> None:
        if "{" not in prefix or "}" not in prefix:
            raise ValueError(f"key prefix must contain a hash tag like '{{kvrs}}:': {prefix!r}")
        self.prefix = prefix

    def __call__(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)
