"""Redis connections and key naming shared by the Redis-backed services.

`REDIS_URL` names one Redis (`redis://`, `rediss://`) or a Redis Cluster
(`redis+cluster://host:port[,host:port...]`, `rediss+cluster://` with TLS): the
listed nodes are where the client starts, it discovers the rest and follows slot
moves and failovers itself.

Every key lives under a hash-tagged prefix (default "{kvrs}:"). Keys under one hash
tag share a Redis Cluster slot, so a Lua script touching several of them runs on one
node atomically; tests isolate by prefix. A service that spreads its keys over the
cluster's primaries uses several tags derived from the prefix (`Keys.shard`): shard
`k` of `{kvrs}:` is `{kvrs.k}:`, and each atomic script still stays inside one shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import redis.asyncio as redis_async
import redis.exceptions
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster

from kvrs.rpc import ConfigError, env_str

DEFAULT_KEY_PREFIX = "{kvrs}:"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
"""`REDIS_URL` schemes that name a Redis Cluster by some of its nodes."""

RedisClient = redis_async.Redis | RedisCluster
"""What `connect_redis` returns: one Redis, or a Redis Cluster behind one client."""


def _closed_under(exc: AttributeError) -> redis.exceptions.ConnectionError:
    return redis.exceptions.ConnectionError(
        f"Redis Cluster connection closed under a command (topology change): {exc}"
    )


class _Pipeline(ClusterPipeline):
    """A cluster pipeline whose failover-time client error is a ConnectionError, and that
    waits for the topology first (see `_Cluster`)."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        await self.cluster_client.initialize()
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except AttributeError as exc:
            raise _closed_under(exc) from exc


class _Cluster(RedisCluster):
    """The Redis Cluster client, with one failure made what it is.

    When a primary dies, redis-py's cluster client closes every node's connections to
    re-read the topology, including connections other commands are using at that
    moment; those fail with an AttributeError from inside the client. It is a lost
    connection, and raising it as a ConnectionError lets every caller treat it as one
    (UNAVAILABLE, a retry, an expiry resume).

    The same happens on a new client: commands started together before it has read the
    topology (a gossip replica's first operation runs one script per registry shard at
    once) look up their nodes from the start-up nodes, and the topology read then closes
    those connections under them. Every command therefore waits for the topology first
    (`initialize` returns at once once it is read, and re-reads it after a failure)."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        await self.initialize()
        try:
            return await super().execute_command(*args, **kwargs)
        except AttributeError as exc:
            raise _closed_under(exc) from exc

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)
        return _Pipeline(self, transaction)  # type: ignore[abstract]


def is_cluster_url(url: str) -> bool:
    """Whether `url` names a Redis Cluster (`redis+cluster://`, `rediss+cluster://`)."""
    return url.startswith(CLUSTER_SCHEMES)


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
        if (tls.ca_file or tls.cert_file) and not redis_url.startswith(
            ("rediss://", "rediss+cluster://")
        ):
            raise ConfigError(
                "KVRS_REDIS_TLS_* need a rediss:// REDIS_URL (or rediss+cluster://), "
                f"got {redis_url.partition(':')[0]}://"
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
    if is_cluster_url(url):
        cluster_nodes(url)  # names REDIS_URL when a node is malformed
    return url, prefix, RedisTls.from_env(url, env)


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """The start-up nodes, user and password of a `redis+cluster://` URL."""
    rest = url.partition("://")[2].partition("/")[0]
    credentials, _, hosts = rest.rpartition("@")
    user, _, password = credentials.partition(":")
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                f"REDIS_URL: a Redis Cluster node must be host:port, got {item!r} in {url!r}"
            )
        nodes.append((host.strip("[]"), int(port)))
    return nodes, unquote(user) or None, unquote(password) or None


def connect_redis(url: str, tls: RedisTls | None = None) -> RedisClient:
    """A pooled async client for `redis://`, `rediss://` (with `tls`), AUTH in the URL,
    and a Redis Cluster (`redis+cluster://`, `rediss+cluster://`)."""
    options: dict[str, Any] = {}
    if tls is not None and tls.ca_file:
        options["ssl_ca_certs"] = tls.ca_file
    if tls is not None and tls.cert_file:
        options.update(ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file)
    if is_cluster_url(url):
        nodes, user, password = cluster_nodes(url)
        # The cluster client retries a command itself (on the new primary after a
        # failover, or after a timeout), as `retry_on_timeout` does for one Redis.
        return _Cluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],
            username=user,
            password=password,
            ssl=url.startswith("rediss+cluster://"),
            socket_connect_timeout=1.0,
            socket_timeout=2.0,
            health_check_interval=5,
            **options,
        )
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

    def shard(self, index: int, shards: int) -> Keys:
        """The keys of shard `index` of `shards`: the prefix itself when there is one
        shard, else the prefix with `.index` appended to its hash tag (`{kvrs}:` ->
        `{kvrs.3}:`), so each shard is a slot of its own on Redis Cluster."""
        if not 0 <= index < shards:
            raise ValueError(f"shard {index} of {shards}")
        if shards == 1:
            return self
        close = self.prefix.index("}", self.prefix.index("{"))
        return Keys(f"{self.prefix[:close]}.{index}{self.prefix[close:]}")
